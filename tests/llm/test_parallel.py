"""ParallelRunner (continuous batching, `ggrun parallel`): every sequence served in a shared batch
gets the same logits and tokens as the same tokens generated alone on a fresh session; the system
prompt is evaluated once and shared; a full cache makes sequences wait; one that can never fit is
reported and skipped. Synthetic tiny llama for the exact checks, SmolLM2 for batch invariance."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.dtypes import DType
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.generate import eval_prompt, generate
from ggrun.core.llm.model import Model
from ggrun.core.llm.parallel import (PREFIX_WAIT, STOP_CACHE, STOP_TEXT, SYSTEM_SEQ, ParallelRunner, SequenceResult,
                                     step_budget)
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams

GREEDY = SamplingParams(temp=0.0)
_rng = np.random.default_rng(7)
# Token ids of the tiny vocabulary (256 bytes + merges; the control token 276 left out).
SYSTEM = [int(t) for t in _rng.integers(0, 276, 24)]
PROMPTS = [(f"prompt {i}", [int(t) for t in _rng.integers(0, 276, n)])
           for i, n in enumerate([5, 13, 3, 21, 8, 1, 17])]


class RecordingSampler(Sampler):
    """A sampler that keeps every row of logits it is given, tagged with the job its client serves."""

    def __init__(self, params: SamplingParams, n_ctx: int, client=None) -> None:
        super().__init__(params, n_ctx)
        self.client = client
        self.rows: dict[int, list[np.ndarray]] = {}

    def sample(self, logits: np.ndarray) -> int:
        job = self.client.job if self.client is not None else 0
        self.rows.setdefault(job, []).append(np.array(logits, dtype=np.float32))
        return super().sample(logits)


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


def run_parallel(model: Model, prompts, n_clients: int = 3, n_predict: int = 6, n_ctx: int = 512,
                 system=SYSTEM, n_batch: int = 512, n_ubatch: int = 512, sampling: SamplingParams = GREEDY,
                 record: bool = False, ignore_eos: bool = True, kv_type: DType = DType.F16,
                 chunk: int | None = None, steps: list | None = None, prefix_share: bool = True,
                 mask_from_cells: bool | None = None):
    """(runner, session, {job: result}, summary, {job: logits rows}) of one parallel run; `steps`, when
    given, receives for each step its batch's sequence ids and, as the step began, each busy client's
    sequence id with its job and its prompt tokens still to read (a client whose sequence has ended, to be
    settled while the step computes, is not busy)."""
    s = Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_clients + 1,
                                     type_k=kv_type, type_v=kv_type, mask_from_cells=mask_from_cells))
    r = ParallelRunner(s, n_clients, n_predict, sampling, n_batch, ignore_eos=ignore_eos, keep_logits=record,
                       chunk=chunk, prefix_share=prefix_share)
    if steps is not None:
        real_step, real_begin = r._step, r._begin

        def step(prompts):
            steps.append([None, {c.seq_id: (c.job, len(c.pending)) for c in r.clients if c.job >= 0 and not c.ending}])
            return real_step(prompts)

        def begin(batch, sampling, ahead=0, tokens=None):
            steps[-1][0] = batch.seq.copy()
            return real_begin(batch, sampling, ahead, tokens)

        r._step, r._begin = step, begin
    results: dict[int, SequenceResult] = {}

    def done(res: SequenceResult) -> None:
        assert res.seq not in results, f"sequence {res.seq} reported twice"
        results[res.seq] = res

    summary = r.run(list(system), prompts, done)
    return r, s, results, summary, r.logits or {}


def run_alone(model: Model, tokens: list[int], n_predict: int, n_ctx: int = 512,
              sampling: SamplingParams = GREEDY, ignore_eos: bool = True,
              kv_type: DType = DType.F16) -> tuple[list[int], list[np.ndarray]]:
    """Generation of one sequence on a fresh session: (tokens, logits of each step)."""
    s = Session(model, SessionParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, type_k=kv_type, type_v=kv_type))
    sampler = RecordingSampler(sampling, n_ctx)
    out, _ = generate(s, tokens, n_predict, sampler, lambda t: None, ignore_eos=ignore_eos)
    return out, sampler.rows.get(0, [])


def assert_cache_holds_only_system(s: Session, n_system: int) -> None:
    used = s.kv.pos >= 0
    assert int(np.count_nonzero(used)) == n_system
    assert sorted(s.kv.pos[used].tolist()) == list(range(n_system))
    assert s.kv.seqs[used, SYSTEM_SEQ].all()
    others = np.delete(s.kv.seqs, SYSTEM_SEQ, axis=1)
    assert not others.any(), "a finished sequence still owns cells"
    assert not s.kv.seqs[~used].any()


@pytest.mark.parametrize("kv_type,atol", [(DType.F32, 1e-3), (DType.F16, 1e-2)], ids=["kv-f32", "kv-f16"])
@pytest.mark.parametrize("n_batch,n_ubatch", [(512, 512), (16, 7)], ids=["one-ubatch", "chunked"])
def test_batched_logits_equal_alone(tiny, n_batch, n_ubatch, kv_type, atol):
    """Each sequence's logits at every step agree with the same tokens generated alone; with a small -b
    the prompts arrive in chunks beside other clients' decode tokens, and -ub splits the batch.

    With an f32 cache batched and alone logits differ by float summation order only (~3e-6). An f16
    cache rounds each K/V element once; a last-bit difference in a batched matmul sometimes rounds one
    element the other way (one f16 ulp, ~1e-3 relative), which moves a logit by up to ~1e-3: noise of
    the cache type, not of batching, hence the looser bound there."""
    n_predict = 6
    _, s, results, summary, rows = run_parallel(tiny, PROMPTS, n_predict=n_predict, n_batch=n_batch,
                                                n_ubatch=n_ubatch, record=True, kv_type=kv_type)
    assert sorted(results) == list(range(len(PROMPTS)))
    for job, (_, prompt) in enumerate(PROMPTS):
        res = results[job]
        assert not res.skipped and res.prompt_tokens == prompt
        want, want_rows = run_alone(tiny, SYSTEM + prompt, n_predict, kv_type=kv_type)
        assert res.response_tokens == want, f"sequence {job}"
        assert len(rows[job]) == len(want_rows) == n_predict
        for step, (got, exp) in enumerate(zip(rows[job], want_rows)):
            np.testing.assert_allclose(got, exp, atol=atol, rtol=0, err_msg=f"sequence {job} step {step}")
    assert summary.n_gen == n_predict * len(PROMPTS)
    assert_cache_holds_only_system(s, len(SYSTEM))


def test_system_prompt_is_evaluated_once_and_shared(tiny, monkeypatch):
    """The system tokens are decoded once (sequence 0); clients decode only their own tokens, at
    positions after the system prompt, and see the system cells through seq_cp."""
    batches = []
    real = Session._decode

    def spy(self, batch, *args, **kw):  # every decode path (logits, argmax, sampled) passes here
        batches.append((list(batch.pos), list(batch.seq)))
        return real(self, batch, *args, **kw)

    monkeypatch.setattr(Session, "_decode", spy)
    _, s, results, summary, _ = run_parallel(tiny, PROMPTS, n_predict=4)
    n_sys = len(SYSTEM)
    system_rows = [(p, q) for pos, seq in batches for p, q in zip(pos, seq) if q == SYSTEM_SEQ]
    assert sorted(p for p, _ in system_rows) == list(range(n_sys)), "system prompt evaluated more than once"
    client_rows = [(p, q) for pos, seq in batches for p, q in zip(pos, seq) if q != SYSTEM_SEQ]
    assert min(p for p, _ in client_rows) == n_sys
    assert len(client_rows) == sum(len(t) for _, t in PROMPTS) + 3 * len(PROMPTS)  # prompt + n_predict - 1
    assert summary.n_prompt == sum(len(t) for _, t in PROMPTS)  # llama-parallel: the clients' prompts
    assert summary.n_system == n_sys
    assert_cache_holds_only_system(s, n_sys)


def test_without_system_prompt(tiny):
    _, s, results, summary, _ = run_parallel(tiny, PROMPTS[:4], n_predict=4, system=[])
    for job, (_, prompt) in enumerate(PROMPTS[:4]):
        assert results[job].response_tokens == run_alone(tiny, prompt, 4)[0]
    assert s.kv.n_used == 0 and not s.kv.seqs.any()


def test_small_cache_makes_sequences_wait(tiny):
    """With room for about one and a half sequences, clients wait for cells instead of failing, and
    every sequence ends with the tokens it gets with plenty of room."""
    n_predict = 6
    _, _, roomy, _, _ = run_parallel(tiny, PROMPTS, n_predict=n_predict)
    longest = max(len(t) for _, t in PROMPTS) + n_predict
    n_ctx = len(SYSTEM) + longest + longest // 2
    r, s, tight, summary, _ = run_parallel(tiny, PROMPTS, n_predict=n_predict, n_ctx=n_ctx)
    assert summary.cache_misses > 0
    assert sorted(tight) == sorted(roomy)
    for job in roomy:
        assert not tight[job].skipped
        assert tight[job].response_tokens == roomy[job].response_tokens, f"sequence {job}"
    assert_cache_holds_only_system(s, len(SYSTEM))


def test_sequence_that_fills_the_cache_exactly_runs(tiny):
    """System + prompt + n_predict - 1 decoded tokens == n_ctx fits (the last sampled token is never
    decoded), and matches the alone run in a context of the same size."""
    n_predict = 5
    prompt = PROMPTS[3][1]
    n_ctx = len(SYSTEM) + len(prompt) + n_predict - 1
    _, s, results, summary, _ = run_parallel(tiny, [("exact", prompt)], n_predict=n_predict, n_ctx=n_ctx)
    assert not results[0].skipped, results[0].skipped
    assert results[0].response_tokens == run_alone(tiny, SYSTEM + prompt, n_predict, n_ctx=n_ctx)[0]
    assert_cache_holds_only_system(s, len(SYSTEM))


def test_sequence_that_can_never_fit_is_skipped(tiny):
    """A prompt longer than the cache beside the system prompt is reported and skipped; the others
    complete undisturbed (same tokens as without it) and nothing crashes."""
    n_predict = 4
    n_ctx = len(SYSTEM) + 40
    huge = ("huge", [int(t) for t in np.random.default_rng(3).integers(0, 276, 60)])
    prompts = PROMPTS[:3] + [huge] + PROMPTS[3:5] + [("empty", [])]
    _, _, plain, _, _ = run_parallel(tiny, PROMPTS[:5], n_predict=n_predict, n_ctx=n_ctx)
    _, s, results, summary, _ = run_parallel(tiny, prompts, n_predict=n_predict, n_ctx=n_ctx)
    assert sorted(results) == list(range(len(prompts)))
    for job in (3, 6):
        assert results[job].skipped and results[job].response_tokens == []
    assert "60" in results[3].skipped and "empty" in results[6].skipped
    for job, want in zip([0, 1, 2, 4, 5], [0, 1, 2, 3, 4]):
        assert not results[job].skipped
        assert results[job].response_tokens == plain[want].response_tokens
    assert summary.n_gen == sum(len(plain[j].response_tokens) for j in plain)
    assert_cache_holds_only_system(s, len(SYSTEM))


def test_finished_client_starts_the_next_sequence_at_once(tiny, monkeypatch):
    """When a sequence ends early at an end-of-generation token its client frees its cells and takes the
    next prompt in the same step; every result still equals its alone run with the same stop token."""
    n_predict = 6
    _, _, free, _, _ = run_parallel(tiny, PROMPTS, n_predict=n_predict)
    stop = free[1].response_tokens[2]  # some sequences now stop early, at different steps
    monkeypatch.setattr(tiny.tokenizer, "eog_ids", frozenset({stop}))
    r, s, results, _, _ = run_parallel(tiny, PROMPTS, n_predict=n_predict, ignore_eos=False)
    lengths = set()
    for job, (_, prompt) in enumerate(PROMPTS):
        want = run_alone(tiny, SYSTEM + prompt, n_predict, ignore_eos=False)[0]
        assert results[job].response_tokens == want, f"sequence {job}"
        assert stop not in want
        lengths.add(len(want))
    assert len(lengths) > 1, "the stop token should end sequences at different steps"
    assert_cache_holds_only_system(s, len(SYSTEM))


def test_repeat_penalty_sees_only_the_sequence_itself(tiny):
    """A client serving several sequences in turn penalizes only the current sequence's tokens (system
    prompt, prompt, response), exactly as `generate` does for the same tokens alone."""
    sampling = SamplingParams(temp=0.0, repeat_penalty=1.8, repeat_last_n=64)
    n_predict = 8
    _, _, results, _, _ = run_parallel(tiny, PROMPTS, n_clients=2, n_predict=n_predict, sampling=sampling)
    for job, (_, prompt) in enumerate(PROMPTS):
        want = run_alone(tiny, SYSTEM + prompt, n_predict, sampling=sampling)[0]
        assert results[job].response_tokens == want, f"sequence {job}"


def test_seeded_sampling_is_reproducible(tiny):
    sampling = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    runs = [run_parallel(tiny, PROMPTS, n_predict=6, sampling=sampling)[2] for _ in range(2)]
    assert {j: r.response_tokens for j, r in runs[0].items()} == {j: r.response_tokens for j, r in runs[1].items()}


def test_more_clients_than_prompts(tiny):
    _, s, results, _, _ = run_parallel(tiny, PROMPTS[:2], n_clients=5, n_predict=3)
    assert sorted(results) == [0, 1]
    assert all(len(r.response_tokens) == 3 for r in results.values())
    assert_cache_holds_only_system(s, len(SYSTEM))


def scripted_runner(model: Model, replies: list[str], n_predict: int, stop_text: str | None = "User:",
                    cont_batching: bool = True, n_clients: int = 2, n_ctx: int = 512,
                    sampling: SamplingParams = GREEDY):
    """(session, runner, starts): each new sequence draws the bytes of the next of `replies` in turn (the tiny
    vocabulary's ids 0..255 are the bytes), then 'x'; `starts` logs, as each sequence starts, its job and the
    jobs of all clients then."""
    s = Session(model, SessionParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_seq_max=n_clients + 1))
    r = ParallelRunner(s, n_clients, n_predict, sampling, 512, ignore_eos=True, stop_text=stop_text,
                       cont_batching=cont_batching)
    scripts = iter(replies)
    starts: list[tuple[int, list[int]]] = []
    script: dict[int, list[int]] = {}
    real_start, real_step, real_follow = r._try_start, r._step, r._follow

    def start(c, job, prompts):
        verdict = real_start(c, job, prompts)
        if verdict == "started":
            starts.append((job, [o.job for o in r.clients]))
            script[c.id] = list(next(scripts).encode())
        return verdict

    def scripted(launched):  # each row's next byte of its script, once, when the step's ids are first asked for
        if launched is None:
            return None
        wait, done = launched.wait, []

        def ids_of_script():
            if not done:
                ids, logits = wait()
                ids = np.array(ids)
                for i, c in enumerate(launched.rows):
                    if c.serial == launched.serials[i]:
                        ids[i] = script[c.id].pop(0) if script[c.id] else ord("x")
                done.append((ids, logits))
            return done[0]
        launched.wait = ids_of_script
        return launched

    r._try_start = start
    r._step = lambda prompts: scripted(real_step(prompts))
    r._follow = lambda step, may_join: scripted(real_follow(step, may_join))
    return s, r, starts


def test_response_stops_at_the_next_user_turn(tiny):
    """As llama-parallel: the response ends once its text holds 'User:' (from the third token on), and the
    text is cut there; the tokens decoded up to that point are counted."""
    s, r, _ = scripted_runner(tiny, ["Paris is.\nUser: and", "no turn here at all"], n_predict=30)
    done: list[SequenceResult] = []
    summary = r.run(list(SYSTEM), PROMPTS[:2], done.append)
    by_job = {d.seq: d for d in done}
    assert by_job[0].response == "Paris is.\n"
    assert by_job[0].n_response == len("Paris is.\nUser:")
    assert by_job[1].n_response == 30 and by_job[1].response.startswith("no turn here at all")
    assert summary.n_gen == len("Paris is.\nUser:") + 30
    assert_cache_holds_only_system(s, len(SYSTEM))


def test_a_step_launched_past_a_sequences_end_gives_its_draw_back(tiny):
    """The next step is launched before the step before is settled, so a sequence that ends by its text has a
    row in it: that row's token is dropped and its draw given back. Every draw a client's stream makes is
    then taken by a token, in the stream's order, as when every step waited for the one before."""
    replies = ["abUser:", "abcdUser:", "aUser:", "abcdefgUser:", "abcUser:"]
    sampling = SamplingParams(temp=0.8, seed=7)
    s, r, _ = scripted_runner(tiny, replies, n_predict=0, sampling=sampling)
    taken: dict[int, list[float]] = {}
    real_take = r._take

    def take(step):
        draws = step.sampling.draws.view(np.float64)[:, 0]
        for i, c in enumerate(step.rows):
            if c.serial == step.serials[i]:
                taken.setdefault(c.id, []).append(float(draws[i]))
        return real_take(step)

    given_back = []
    real_unread = r.sampler.unread

    def unread(slot, rows, i):
        given_back.append(slot)
        real_unread(slot, rows, i)

    r._take, r.sampler.unread = take, unread
    done: list[SequenceResult] = []
    r.run(list(SYSTEM), PROMPTS[:2] + PROMPTS[:3], done.append)
    assert len(given_back) == len(replies), "each sequence ends by its text with a row launched past its end"
    assert sorted(d.response for d in done) == sorted(x[:x.index("User:")] for x in replies)
    for client, draws in taken.items():
        stream = np.random.default_rng(sampling.seed + client)
        assert draws == [stream.random() for _ in draws], f"client {client}'s draws"
    assert sum(len(v) for v in r.sampler.unread_draws) <= len(r.clients)
    assert_cache_holds_only_system(s, len(SYSTEM))


def test_without_continuous_batching_new_sequences_wait_for_all(tiny):
    """-nocb: a client that finishes early stays idle until every client has finished."""
    replies = ["abUser:", "abcdefghUser:", "abUser:", "abcdefghUser:"]
    s, r, starts = scripted_runner(tiny, replies, n_predict=0, cont_batching=False)
    done: list[SequenceResult] = []
    r.run(list(SYSTEM), PROMPTS[:4], done.append)
    assert [j for j, _ in starts] == [0, 1, 2, 3]
    assert starts[2][1] == [2, -1] and starts[3][1] == [2, 3]  # 2 and 3 started together, after 0 and 1 ended
    assert [d.seq for d in done] == [0, 1, 2, 3]
    assert [d.response for d in done] == ["ab", "abcdefgh", "ab", "abcdefgh"]


def test_without_n_predict_a_response_gets_a_share_of_the_cache(tiny):
    """-n 0: no token limit but the cache: each of 2 clients may use half of the cells beside the system
    prompt, less its prompt."""
    s, r, _ = scripted_runner(tiny, ["x" * 1000, "x" * 1000], n_predict=0, stop_text=None, n_ctx=256)
    done: list[SequenceResult] = []
    r.run(list(SYSTEM), PROMPTS[:2], done.append)
    share = (256 - len(SYSTEM)) // 2
    assert {d.seq: d.n_response for d in done} == {j: share - len(PROMPTS[j][1]) for j in (0, 1)}


def test_a_sequence_whose_cache_share_runs_out_is_told_while_the_others_go_on(tiny):
    """-n 0: the client whose response never ends gets STOP_CACHE at the end of its share; the other, whose
    response ends by the stop text, and the sequence started after it finish by themselves."""
    s, r, _ = scripted_runner(tiny, ["x" * 1000, "abUser:", "cdUser:"], n_predict=0, n_ctx=256)
    done: list[SequenceResult] = []
    r.run(list(SYSTEM), PROMPTS[:3], done.append)
    by_job = {d.seq: d for d in done}
    assert by_job[0].stop_reason == STOP_CACHE
    assert by_job[0].n_response == (256 - len(SYSTEM)) // 2 - len(PROMPTS[0][1])
    assert by_job[1].stop_reason == by_job[2].stop_reason == STOP_TEXT
    assert [by_job[1].response, by_job[2].response] == ["ab", "cd"]
    assert [d.seq for d in done] == [1, 2, 0]  # the other two ended while sequence 0 went on
    assert_cache_holds_only_system(s, len(SYSTEM))


def test_sequences_join_and_leave_across_buckets(tiny):
    """Five clients over seven prompts ending at different steps: the step's bucket changes as clients
    join and leave, and every sequence still gets its alone run's tokens."""
    n_predict = 9
    _, _, free, _, _ = run_parallel(tiny, PROMPTS, n_clients=5, n_predict=n_predict)
    stops = {free[0].response_tokens[1], free[3].response_tokens[4]}
    tok = tiny.tokenizer
    saved = tok.eog_ids
    tok.eog_ids = frozenset(stops)
    try:
        r, s, results, _, _ = run_parallel(tiny, PROMPTS, n_clients=5, n_predict=n_predict, ignore_eos=False)
        for job, (_, prompt) in enumerate(PROMPTS):
            assert results[job].response_tokens == run_alone(tiny, SYSTEM + prompt, n_predict, ignore_eos=False)[0]
    finally:
        tok.eog_ids = saved
    sizes = {why for reused, why in s.stats.reuse_log if not reused}
    assert any("n_tokens" in why for why in sizes), "the bucket never changed"
    assert_cache_holds_only_system(s, len(SYSTEM))


LONG = [("long", [int(t) for t in _rng.integers(0, 276, 150)])]


def test_decoding_sequences_advance_while_a_long_prompt_is_read_in_chunks(tiny):
    """Chunked prefill: two clients generate while a third reads a 150-token prompt in steps of at most 16
    tokens; every one of those steps carries one token of each generating client, and the long prompt
    spans many steps instead of one."""
    steps: list = []
    chunk = 16
    run_parallel(tiny, PROMPTS[:2] + LONG, n_predict=24, chunk=chunk, steps=steps)
    long_seq = None
    reading = []  # steps that hold long-prompt tokens while the two others generate
    for seq, clients in steps:
        long_seq = next((sid for sid, (job, _) in clients.items() if job == 2), long_seq)
        generating = [sid for sid, (job, pending) in clients.items() if job != 2 and pending == 0]
        if long_seq is not None and long_seq in seq and len(generating) == 2:
            reading.append((seq, generating))
    assert len(reading) >= 150 // chunk - 1, f"the long prompt went in {len(reading)} steps"
    for seq, generating in reading:
        assert len(seq) <= chunk
        for sid in generating:
            assert np.count_nonzero(seq == sid) == 1, "a generating client missed a step"


def test_a_long_prompt_read_in_chunks_attends_over_the_cells_it_will_fill(tiny):
    """Where n_kv is a power of two of the cells in use (masks made from the cells), a 600-token prompt read in
    64-token chunks attends from its first chunk over the cells it will fill (the runner's `ahead`): every full
    chunk runs one graph, where n_kv growing with the chunks built one at 256, 512 and 1024 cells."""
    s = Session(tiny, SessionParams(n_ctx=1024, n_batch=64, n_ubatch=64, n_seq_max=2, mask_from_cells=True))
    r = ParallelRunner(s, 1, 2, GREEDY, 64, ignore_eos=True, chunk=64)
    built: list[int] = []
    real = s.build

    def build(p):
        built.append(p.n_kv)
        return real(p)

    s.build = build
    r.run([], [("long", [int(t) for t in np.random.default_rng(5).integers(0, 276, 600)])], lambda _: None)
    assert len(built) <= 3, built  # the full chunks', the last chunk's (24 tokens, padded to 32), a decode step's
    assert len(set(built)) == 1, built


@pytest.fixture(scope="module")
def tiny_f32(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()], numerics="f32")


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_gives_the_unchunked_tokens_f32_numerics(tiny_f32, chunk):
    """With --numerics f32 (results independent of batching), prompts read in chunks beside other clients'
    decode steps give every sequence the tokens of prompts read whole, and its logits up to float summation
    order (an f32 cache, so that no f16 rounding of a key flips; a chunk's cells may lie in other tiles of
    the cache than the whole prompt's)."""
    prompts = PROMPTS + LONG
    whole = run_parallel(tiny_f32, prompts, n_predict=8, chunk=512, record=True, kv_type=DType.F32)
    chunked = run_parallel(tiny_f32, prompts, n_predict=8, chunk=chunk, record=True, kv_type=DType.F32)
    for job in range(len(prompts)):
        assert chunked[2][job].response_tokens == whole[2][job].response_tokens, f"sequence {job}"
        for a, b in zip(chunked[4][job], whole[4][job]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"sequence {job}")


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temp=0.9, top_k=20, seed=3)], ids=["greedy", "sampled"])
def test_padded_mixed_steps_draw_the_unpadded_tokens_f32_numerics(tiny_f32, sampling):
    """With masks made from the cells (a GPU session of many sequences), steps where prompts join decoding
    sequences pad their tokens and, their tokens being drawn in the graph, their outputs to a quarter of the padded
    tokens at least (buckets.pad_mixed): every sequence draws the tokens of the unpadded session."""
    prompts = PROMPTS + LONG
    plain = run_parallel(tiny_f32, prompts, n_predict=8, chunk=16, kv_type=DType.F32, sampling=sampling,
                         mask_from_cells=False)
    padded = run_parallel(tiny_f32, prompts, n_predict=8, chunk=16, kv_type=DType.F32, sampling=sampling,
                          mask_from_cells=True)
    # the steps of 16 tokens are mixed ones (prompt chunks of 16 beside the decoding clients): 1 output unpadded
    outs = {p.n_outputs for p in padded[1].graphs._graphs if p.n_tokens == 16 and p.n_outputs}
    assert outs and min(outs) >= 4, f"mixed steps of 16 tokens with {sorted(outs)} outputs"
    for job in range(len(prompts)):
        assert padded[2][job].response_tokens == plain[2][job].response_tokens, f"sequence {job}"


COMMON = [int(t) for t in _rng.integers(0, 276, PREFIX_WAIT + 16)]
ALIKE = [(f"alike {i}", COMMON + prompt) for i, (_, prompt) in enumerate(PROMPTS)]


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_prompts_that_begin_alike_share_cells_f32_numerics(tiny_f32, chunk):
    """Seven prompts beginning with the same 80 tokens, three clients: the first reads them and the others
    wait for it (a prefix in flight), then take its cells; each later sequence shares them from a running
    one. Every sequence gets the tokens of prompts read whole, and its logits up to float summation order;
    the cache ends with nothing but the system prompt."""
    whole = run_parallel(tiny_f32, ALIKE, n_predict=8, record=True, kv_type=DType.F32, prefix_share=False)
    steps: list = []
    shared = run_parallel(tiny_f32, ALIKE, n_predict=8, record=True, kv_type=DType.F32, chunk=chunk, steps=steps)
    for job in range(len(ALIKE)):
        assert shared[2][job].response_tokens == whole[2][job].response_tokens, f"sequence {job}"
        for a, b in zip(shared[4][job], whole[4][job], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"sequence {job}")
    assert whole[3].n_prompt_shared == 0
    assert shared[3].n_prompt_shared >= len(COMMON) * (len(ALIKE) - 2)
    assert shared[3].n_prompt_shared % len(COMMON) == 0
    first = steps[0][1]
    assert len(first) == 1, "the second client read the common prefix beside the first"
    assert_cache_holds_only_system(shared[1], len(SYSTEM))


def test_a_prompt_shares_no_more_than_all_but_its_last_token(tiny_f32):
    """A prompt that is all another's prefix still decodes its last token (the logits of its first response
    token), and gets the tokens it gets alone."""
    prompts = [("long", COMMON + [5, 6, 7]), ("prefix", list(COMMON))]
    r, s, results, summary, _ = run_parallel(tiny_f32, prompts, n_clients=2, n_predict=4, kv_type=DType.F32)
    assert summary.n_prompt_shared == len(COMMON) - 1
    assert results[1].response_tokens == run_alone(tiny_f32, SYSTEM + list(COMMON), 4, kv_type=DType.F32)[0]


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_sliding_window_sequences_get_their_alone_tokens_f32_numerics(tiny_gemma3_factory, chunk):
    """A tiny gemma3 (a window of 8 positions on most layers, its own cache): three clients over prompts
    longer and shorter than the window, read whole or in chunks, each get the tokens of the same prompt
    generated alone, and its logits up to float summation order, under --numerics f32."""
    model = Model.load(tiny_gemma3_factory(), [CPUBackend()], numerics="f32")
    prompts = PROMPTS[:5] + LONG
    _, s, results, _, rows = run_parallel(model, prompts, n_predict=8, chunk=chunk, kv_type=DType.F32, record=True)
    for job, (_, prompt) in enumerate(prompts):
        want, want_rows = run_alone(model, SYSTEM + prompt, 8, kv_type=DType.F32)
        assert results[job].response_tokens == want, f"sequence {job}"
        for got, exp in zip(rows[job], want_rows, strict=True):
            np.testing.assert_allclose(got, exp, rtol=0, atol=1e-4, err_msg=f"sequence {job}")
    assert s.kv_swa is not None


def test_step_budget():
    """The chunk defaults to one micro-batch and never exceeds -b."""
    assert step_budget(None, 2048, 512) == 512
    assert step_budget(0, 256, 256) == 256
    assert step_budget(64, 2048, 512) == 64
    assert step_budget(4096, 2048, 512) == 2048


# ---- SmolLM2 ------------------------------------------------------------------------------------


def smollm2_jobs(model: Model, n: int) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """The system prompt and the first n questions as `ggrun parallel -pps` tokenizes them."""
    from ggrun.cli.parallel_prompts import QUESTIONS, SYSTEM_PROMPT, format_turn

    tok = model.tokenizer
    system = tok.tokenize(SYSTEM_PROMPT, add_special=True, parse_special=False)
    return system, [(q, tok.tokenize(format_turn(q), add_special=False, parse_special=False)) for q in QUESTIONS[:n]]


def followed_diff(s: Session, first: np.ndarray, pos: int, tokens: list[int], rows: list[np.ndarray]) -> float:
    """The largest logit difference from `rows` over the steps of sequence 0 on session s, whose prompt's last
    logits are `first` (its next position `pos`), fed `tokens` (a run alone's, whose logits are rows)."""
    diff = float(np.abs(first - rows[0]).max())
    for i, t in enumerate(tokens[:len(rows) - 1]):
        got = s.decode(Batch.of_sequence([t], pos + i, 0))[0]
        diff = max(diff, float(np.abs(got - rows[i + 1]).max()))
    return diff


def compare_with_alone(model: Model, system, prompts, results, rows, n_predict: int):
    """Per sequence: (first step where batched and alone tokens differ or None, max logit difference of
    each step up to it, alone logits rows, alone tokens)."""
    out = []
    for job, (_, prompt) in enumerate(prompts):
        got = results[job].response_tokens
        want, want_rows = run_alone(model, system + prompt, n_predict, n_ctx=512, ignore_eos=False)
        first = None if got == want else next(i for i, (a, b) in enumerate(zip(got + [-1], want + [-1])) if a != b)
        last = len(want_rows) if first is None else first + 1
        diffs = [float(np.abs(a - b).max()) for a, b in zip(rows[job][:last], want_rows[:last])]
        out.append((first, diffs, want_rows, want))
    return out


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_path):
    """SmolLM2 with --numerics f32: no llama.cpp-style operand rounding, so batching changes
    nothing but the last bits of float sums (and now and then an f16 rounding in the cache)."""
    return Model.load(smollm2_path, [CPUBackend()], numerics="f32")


@pytest.mark.slow
def test_smollm2_batch_invariance_f32_numerics(smollm2_f32):
    """The acceptance run: -np 4 over 8 sequences with --temp 0 gives every sequence exactly the tokens
    of a greedy run of that prompt alone, with logits within the f16 cache's rounding noise: mask,
    positions and the shared system cells are right on a real model."""
    system, prompts = smollm2_jobs(smollm2_f32, 8)
    n_predict = 16
    _, s, results, _, rows = run_parallel(smollm2_f32, prompts, n_clients=4, n_predict=n_predict, n_ctx=1024,
                                          system=system, record=True, ignore_eos=False)
    assert sorted(results) == list(range(8))
    assert_cache_holds_only_system(s, len(system))
    for job, (first, diffs, _, want) in enumerate(compare_with_alone(smollm2_f32, system, prompts, results, rows,
                                                                     n_predict)):
        assert first is None, f"sequence {job} diverges at step {first}"
        assert max(diffs) < 0.1, f"sequence {job}: logit differences {diffs}"


@pytest.mark.slow
def test_smollm2_batch_invariance_llama_numerics(smollm2):
    """-np 4 over 8 sequences with --temp 0 and the default llama numerics: every response equals a
    single-sequence greedy run of the same tokens (system prompt + prompt) on a fresh session, up to
    float near-ties.

    The CPU kernels round activations to 8-bit blocks before a quantized weight (as llama.cpp does);
    a last-bit difference from another matmul shape (a batch of 4 rows instead of 1, a prompt in two
    decodes instead of one) flips a rounding now and then, and over 30 layers the logits of one
    sequence alone already move by about as much when only its prompt is split differently (the
    noise floor, measured here). So where tokens differ, the first divergence must be a near-tie:
    alone's two candidates lie within that noise, and the logits up to there differ by noise only."""
    system, prompts = smollm2_jobs(smollm2, 8)
    n_predict = 16
    _, s, results, _, rows = run_parallel(smollm2, prompts, n_clients=4, n_predict=n_predict, n_ctx=1024,
                                          system=system, record=True, ignore_eos=False)
    assert sorted(results) == list(range(8))
    assert_cache_holds_only_system(s, len(system))
    compared = compare_with_alone(smollm2, system, prompts, results, rows, n_predict)
    # noise floor: sequence 0 alone, (a) its system prompt and prompt decoded in two batches instead of
    # one, (b) its prompt in cells before its system prompt's, as cells freed by finished sequences
    # place it in a batched run: attention sums values in f16 cell by cell as llama.cpp does, so the
    # order of cells moves the result (the compiled products are batch-invariant: (a) gives 0). Each is
    # followed through alone's tokens, and its floor is its largest difference over all the steps, as each
    # batched sequence's is over its steps: one step's floor was below the batched runs' largest differences
    # by chance alone (an Intel Xeon with AVX-512 FP16: 0.547 against 2.03, the tokens the same)
    want_rows, want = compared[0][2], compared[0][3]
    split = Session(smollm2, SessionParams(n_ctx=512, n_batch=len(system), n_ubatch=512))
    floor_split = followed_diff(split, eval_prompt(split, system + prompts[0][1], len(system)),
                                len(system) + len(prompts[0][1]), want, want_rows)
    moved = Session(smollm2, SessionParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_seq_max=2))
    eval_prompt(moved, (system * 300)[:len(prompts[0][1])], 512, seq=1)  # a filler, freed below
    eval_prompt(moved, system, 512, seq=0)
    moved.seq_rm(1)
    floor_moved = followed_diff(moved, eval_prompt(moved, prompts[0][1], 512, seq=0, start_pos=len(system)),
                                len(system) + len(prompts[0][1]), want, want_rows)
    floor = max(floor_split, floor_moved)
    bound = 2.5 * max(floor, 0.05)
    print(f"\nnoise floor (one sequence alone): prompt split in two {floor_split:.3g}, cells moved {floor_moved:.3g}")
    for job, (first, diffs, want_rows, want) in enumerate(compared):
        got = results[job].response_tokens
        print(f"sequence {job}: {'same tokens' if first is None else f'first divergence at step {first}'}; "
              f"max logit difference {max(diffs):.3g}")
        assert max(diffs) < bound, f"sequence {job}: logit differences {diffs} beyond noise (floor {floor:.3g})"
        if first is None:
            continue
        assert first < min(len(got), len(want)), f"sequence {job}: one run ended at an end-of-generation token"
        alone = want_rows[first]
        margin = float(alone[want[first]] - alone[got[first]])
        top2 = np.sort(alone)[-2:]
        msg = (f"sequence {job} ({prompts[job][0]!r}) step {first}: batched {got[first]} alone {want[first]}; "
               f"alone logits {alone[want[first]]:.4f} vs {alone[got[first]]:.4f} (margin {margin:.4g}, alone top-2 "
               f"margin {top2[1] - top2[0]:.4g}); batched-vs-alone max logit difference {diffs[first]:.4g}")
        print(msg)
        assert 0 <= margin < bound and diffs[first] < bound, msg


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temp=0.9, top_k=20, seed=3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("ignore_eos", [True, False], ids=["to-the-limit", "eog-ends"])
def test_steps_launched_as_ids_come_back_change_nothing(tiny, sampling, ignore_eos):
    """Decode steps of the same sequences are launched as soon as the step before's ids are back (_follow): the
    sequences' tokens, texts and ends (at the limit, by the stop text, sampled: at an end-of-generation token),
    and the totals, are those of a run that takes every step's tokens first; most steps are launched so."""
    prompts = PROMPTS * 3

    def run(follow: bool):
        s = Session(tiny, SessionParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_seq_max=4))
        r = ParallelRunner(s, 3, 24, sampling, 512, ignore_eos=ignore_eos, stop_text="e")
        followed = []
        real = r._follow

        def counted(step, may_join):
            launched = real(step, may_join) if follow else None
            followed.append(launched is not None)
            return launched
        r._follow = counted
        done: list[SequenceResult] = []
        summary = r.run(list(SYSTEM), prompts, done.append)
        return {d.seq: (d.response_tokens, d.response, d.stop_reason) for d in done}, summary, followed

    want, base, _ = run(False)
    got, summary, followed = run(True)
    assert got == want
    assert (summary.n_gen, summary.n_prompt) == (base.n_gen, base.n_prompt)
    assert sum(followed) > len(followed) / 2


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temp=0.9, top_k=20, seed=3)], ids=["greedy", "sampled"])
def test_warm_up_builds_the_step_of_every_client_and_changes_nothing(tiny, sampling):
    """The warm-up decodes one token of every client twice and clears the cache: the run then finds the graph of a
    step of every client built (it builds fewer), and its sequences' tokens and texts are a cold run's (the
    warm-up draws from streams of its own)."""
    def run(warm: bool):
        s = Session(tiny, SessionParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_seq_max=4, mask_from_cells=True))
        r = ParallelRunner(s, 3, 10, sampling, 512, ignore_eos=True)
        if warm:
            r.warm_up()
            assert s.kv.n_used == 0
        built = s.stats.graphs_built
        done: list[SequenceResult] = []
        r.run(list(SYSTEM), PROMPTS * 2, done.append)
        return {d.seq: (d.response_tokens, d.response) for d in done}, s.stats.graphs_built - built

    cold, built_cold = run(False)
    warm, built_warm = run(True)
    assert warm == cold
    assert built_warm < built_cold


def test_warm_up_reads_a_system_prompt_of_its_length_and_changes_nothing(tiny):
    """Given the system prompt's length, the warm-up also reads that many placeholder tokens as the run reads its
    system prompt (llama-parallel's -pps): the run's system prompt then finds the graphs of its micro-batches
    (here 16, then 8 tokens) built, and the sequences' tokens are those of a warm-up without it."""
    def run(n_system: int):
        s = Session(tiny, SessionParams(n_ctx=1024, n_batch=16, n_ubatch=16, n_seq_max=4, mask_from_cells=True))
        r = ParallelRunner(s, 3, 10, GREEDY, 16, ignore_eos=True)
        r.warm_up(n_system)
        assert s.kv.n_used == 0
        seen = len(s.stats.reuse_log)
        done: list[SequenceResult] = []
        r.run(list(SYSTEM), PROMPTS * 2, done.append)
        return {d.seq: (d.response_tokens, d.response) for d in done}, s.stats.reuse_log[seen:seen + 2]

    plain, system_plain = run(0)
    warm, system_warm = run(len(SYSTEM))
    assert warm == plain
    assert [reused for reused, _ in system_warm] == [True, True], system_warm
    assert not all(reused for reused, _ in system_plain)


def test_rehearsal_builds_the_opening_graphs_and_changes_nothing(tiny):
    """rehearse serves the opening (the system prompt, each client's first prompt) with a few tokens each, then
    forgets it: the run's opening steps find their graphs built, and every sequence's tokens, texts and the run's
    totals are those of a run without it (sampled: the rehearsal draws from streams of its own)."""
    def run(rehearse: bool):
        s = Session(tiny, SessionParams(n_ctx=1024, n_batch=16, n_ubatch=16, n_seq_max=4, mask_from_cells=True))
        r = ParallelRunner(s, 3, 10, SamplingParams(temp=0.8, seed=5), 16, ignore_eos=True)
        if rehearse:
            r.rehearse(list(SYSTEM), PROMPTS * 2)
            assert s.kv.n_used == 0 and all(c.job < 0 and not c.held for c in r.clients)
        seen = len(s.stats.reuse_log)
        done: list[SequenceResult] = []
        summary = r.run(list(SYSTEM), PROMPTS * 2, done.append)
        results = {d.seq: (d.response_tokens, d.response) for d in done}
        return results, (summary.n_prompt, summary.n_gen, summary.n_prompt_shared), s.stats.reuse_log[seen:seen + 6]

    plain, totals_plain, opening_plain = run(False)
    rehearsed, totals, opening = run(True)
    assert rehearsed == plain and totals == totals_plain
    assert all(reused for reused, _ in opening), opening
    assert not all(reused for reused, _ in opening_plain)


@pytest.mark.parametrize("window", [8, 512], ids=["window-8", "window-512"])
def test_sliding_window_prefixes_are_shared_while_their_cells_are_all_held(tiny_gemma3_factory, window):
    """A tiny gemma3 with sliding-window layers: prompts that begin alike share the prefix's cells while the
    sequence that lends them has left none of them in the window's cache (a window of 512 positions: every
    later sequence shares); with a window of 8 the lender has left its first cells by then, so every prompt is
    read whole. Either way each sequence gets the tokens of its prompt generated alone, and the logits up to
    float summation order (--numerics f32)."""
    model = Model.load(tiny_gemma3_factory(sliding_window=window, n_ctx_train=1024), [CPUBackend()], numerics="f32")
    r, s, results, summary, rows = run_parallel(model, ALIKE[:4], n_predict=6, record=True, kv_type=DType.F32,
                                                n_ctx=1024)
    assert s.kv_swa is not None
    if window > 200:
        assert summary.n_prompt_shared >= len(COMMON) * 2
    else:
        assert summary.n_prompt_shared == 0
    for job, (_, prompt) in enumerate(ALIKE[:4]):
        want, want_rows = run_alone(model, SYSTEM + prompt, 6, n_ctx=1024, kv_type=DType.F32)
        assert results[job].response_tokens == want, f"sequence {job}"
        for got, exp in zip(rows[job], want_rows, strict=True):
            np.testing.assert_allclose(got, exp, rtol=0, atol=1e-4, err_msg=f"sequence {job}")


def test_a_client_reuses_the_prompt_cells_of_its_last_sequence_f32_numerics(tiny_f32):
    """One client (-np 1): each finished sequence leaves its prompt's cells held, so the next prompt that begins
    alike reads only what differs (every later one shares the 80 common tokens); the tokens and logits are those
    of prompts read whole, and the cache ends with nothing but the system prompt."""
    whole = run_parallel(tiny_f32, ALIKE, n_clients=1, n_predict=6, record=True, kv_type=DType.F32,
                         prefix_share=False)
    held = run_parallel(tiny_f32, ALIKE, n_clients=1, n_predict=6, record=True, kv_type=DType.F32)
    for job in range(len(ALIKE)):
        assert held[2][job].response_tokens == whole[2][job].response_tokens, f"sequence {job}"
        for a, b in zip(held[4][job], whole[4][job], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"sequence {job}")
    assert held[3].n_prompt_shared >= len(COMMON) * (len(ALIKE) - 1)
    assert_cache_holds_only_system(held[1], len(SYSTEM))
