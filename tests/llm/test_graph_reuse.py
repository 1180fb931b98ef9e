"""Graph reuse across micro-batches: a kept graph serves the next micro-batch when its shapes match
and nothing invalidated it, gives bitwise the logits a rebuilt one gives, and never runs stale.

Which steps must rebuild is predicted here from positions and the 256-cell n_kv padding alone, not
from the session's own bookkeeping. Runs on SmolLM2 (skipped when not cached) and a tiny llama.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.llm.batch import Batch, split_batch
from ggrun.core.llm.generate import generate
from ggrun.core.llm.graph_result import GraphResult
from ggrun.core.llm.graph_reuse import Decision, REUSED, decide
from ggrun.core.llm.inputs import GraphParams
from ggrun.core.llm.kv_cache import KV_PAD
from ggrun.core.llm.model import Model
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams

PAD = 256  # llama.cpp's n_kv padding; the predictions below assume it
GREEDY = SamplingParams(temp=0)
N_PREDICT = 64
# 20 token ids spread over the tiny vocabulary (bytes, merges, the control token).
TINY_PROMPT = [104, 101, 108, 108, 111, 256, 263, 32, 119, 275, 10, 66, 200, 7, 268, 258, 111, 33, 120, 99]
SMOL_TEXT = ("The lighthouse keeper climbed the spiral stairs each evening, counting the steps aloud. "
             "Below, fishing boats returned to the harbour while gulls argued over scraps on the pier. "
             "She lit the lamp, wrote the weather in her logbook, and watched the beam sweep the dark water. ")
SMOL_PROMPT_LEN = 224  # decode positions 224..287 cross the n_kv boundary at 256


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    monkeypatch.delenv("GGRUN_GRAPH_REUSE", raising=False)
    monkeypatch.delenv("GGRUN_GRAPH_DEBUG", raising=False)


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


class RecordingSampler(Sampler):
    """Greedy sampling that keeps a copy of every row of logits it was given."""

    def __init__(self, n_ctx: int) -> None:
        super().__init__(GREEDY, n_ctx)
        self.rows: list[np.ndarray] = []

    def sample(self, logits):
        self.rows.append(np.array(logits, dtype=np.float32, copy=True))
        return super().sample(logits)


def make_session(model: Model, n_ctx: int, n_ubatch: int = 512, reuse: bool = True) -> Session:
    return Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch, graph_reuse=reuse))


def tiny_prompt(n: int) -> list[int]:
    return [TINY_PROMPT[i % len(TINY_PROMPT)] for i in range(n)]


def predicted_params(prompt_len: int, n_ubatch: int, n_decode: int, n_ctx: int) -> list[GraphParams]:
    """Each micro-batch's shapes for one sequence written from cell 0: the prompt in n_ubatch chunks
    (logits for its last token only), then one token per decode step."""
    out, top = [], 0
    sizes = [min(n_ubatch, prompt_len - i) for i in range(0, prompt_len, n_ubatch)] + [1] * n_decode
    for n in sizes:
        top += n
        n_kv = min(n_ctx, max(PAD, -(-top // PAD) * PAD))
        n_out = 1 if top >= prompt_len else 0
        out.append(GraphParams(n, n_out, n_kv))
    return out


def predicted_reuse(params: list[GraphParams]) -> list[bool]:
    return [i > 0 and p == params[i - 1] for i, p in enumerate(params)]


def run_greedy(model: Model, prompt: list[int], n_ctx: int, n_ubatch: int = 512, reuse: bool = True):
    """Greedy generation of N_PREDICT tokens: (session, tokens, logits per step, buffer state at creation)."""
    s = make_session(model, n_ctx, n_ubatch, reuse)
    created = (s.sched.buffer_sizes(), {k: a.reserves for k, a in s.sched.allocators.items()})
    sampler = RecordingSampler(n_ctx)
    out, _ = generate(s, prompt, N_PREDICT, sampler, lambda t: None, ignore_eos=True)
    return s, out, np.stack(sampler.rows), created


def assert_reuse_as_predicted(s: Session, prompt_len: int, n_ubatch: int, n_ctx: int) -> None:
    params = predicted_params(prompt_len, n_ubatch, N_PREDICT - 1, n_ctx)
    want = predicted_reuse(params)
    assert [reused for reused, _ in s.stats.reuse_log] == want
    assert s.stats.graphs_reused == sum(want) and s.stats.graphs_built == len(want) - sum(want)
    for i, (reused, why) in enumerate(s.stats.reuse_log):
        if i and not reused:  # the reason names exactly the parameters that changed
            changed = [f"{k} {getattr(params[i - 1], k)} -> {getattr(params[i], k)}"
                       for k in ("n_tokens", "n_outputs", "n_kv") if getattr(params[i - 1], k) != getattr(params[i], k)]
            assert why == "rebuilt: " + ", ".join(changed)


def assert_buffers_unchanged(s: Session, created) -> None:
    sizes, reserves = created
    assert s.sched.buffer_sizes() == sizes
    assert {k: a.reserves for k, a in s.sched.allocators.items()} == reserves == {k: 1 for k in reserves}


def test_padding_is_256():
    assert KV_PAD == PAD


# ---- SmolLM2: reuse on and off, 64 greedy tokens across the n_kv boundary ------------------------

@pytest.fixture(scope="module")
def smol_runs(smollm2):
    tokens = smollm2.tokenizer.tokenize(SMOL_TEXT * 6, add_special=True)[:SMOL_PROMPT_LEN]
    assert len(tokens) == SMOL_PROMPT_LEN
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GGRUN_GRAPH_REUSE", raising=False)
        mp.delenv("GGRUN_GRAPH_DEBUG", raising=False)
        return {reuse: run_greedy(smollm2, tokens, 512, reuse=reuse) for reuse in (True, False)}


@pytest.mark.slow
def test_smollm2_reuse_gives_identical_tokens_and_logits(smol_runs):
    (_, on, on_rows, _), (_, off, off_rows, _) = smol_runs[True], smol_runs[False]
    assert len(on) == N_PREDICT and on == off
    assert on_rows.shape[0] == N_PREDICT
    assert np.array_equal(on_rows, off_rows)  # bitwise, the step that crosses n_kv 256 included


@pytest.mark.slow
def test_smollm2_decode_steps_reuse_except_at_the_padding_boundary(smol_runs):
    s = smol_runs[True][0]
    assert_reuse_as_predicted(s, SMOL_PROMPT_LEN, 512, 512)
    rebuilt = [i for i, (reused, _) in enumerate(s.stats.reuse_log) if not reused]
    # the prompt, the first decode step, and the one writing position (and cell) 256
    assert rebuilt == [0, 1, 256 - SMOL_PROMPT_LEN + 1]
    assert s.stats.reuse_log[rebuilt[-1]] == (False, "rebuilt: n_kv 256 -> 512")
    off = smol_runs[False][0]
    assert off.stats.graphs_reused == 0 and off.stats.graphs_built == N_PREDICT
    assert {why for _, why in off.stats.reuse_log[1:]} == {"rebuilt: graph reuse disabled"}


@pytest.mark.slow
def test_smollm2_compute_buffers_do_not_grow(smol_runs):
    for reuse in (True, False):
        s, _, _, created = smol_runs[reuse]
        assert_buffers_unchanged(s, created)


# ---- tiny llama: the same properties over more shapes ----------------------------------------------

@pytest.mark.parametrize("prompt_len,n_ubatch,n_ctx", [(20, 512, 128), (230, 512, 300), (200, 64, 512), (192, 64, 256)],
                         ids=["short", "n_kv-capped-at-n_ctx", "chunked-prompt", "full-ubatch-at-n_ctx"])
def test_tiny_reuse_on_off_identical_and_predicted(tiny, prompt_len, n_ubatch, n_ctx):
    """Reuse on and off give bitwise logits; decode steps reuse except where the prediction says; the
    compute buffer never grows (192 tokens in -ub 64 at -c 256 once needed more than was reserved)."""
    prompt = tiny_prompt(prompt_len)
    s_on, on, on_rows, created_on = run_greedy(tiny, prompt, n_ctx, n_ubatch, reuse=True)
    s_off, off, off_rows, created_off = run_greedy(tiny, prompt, n_ctx, n_ubatch, reuse=False)
    assert on == off and np.array_equal(on_rows, off_rows)
    assert_reuse_as_predicted(s_on, prompt_len, n_ubatch, n_ctx)
    assert_buffers_unchanged(s_on, created_on)
    assert_buffers_unchanged(s_off, created_off)


def test_reserve_covers_every_shape(tiny):
    """Every (n_tokens, n_outputs, n_kv) a session can meet plans within the buffer reserved at creation:
    selecting fewer output rows than tokens adds get_rows, which can need more than all logits do."""
    s = make_session(tiny, n_ctx=300, n_ubatch=12)
    reserved = s.sched.buffer_sizes()
    for n_tokens in range(1, 13):
        for n_outputs in range(n_tokens + 1):
            for n_kv in (256, 300):
                plans = s.sched.measure(s.build(GraphParams(n_tokens, n_outputs, n_kv)).sg)
                for name, plan in plans.items():
                    assert plan.size <= reserved[name], (n_tokens, n_outputs, n_kv)


def test_k_shift_fits_the_reservation(tiny):
    """With -ub 1 the K-shift graph (a rotated copy of a layer's keys over all cells) is the largest;
    it is reserved at creation, so a shift does not grow the buffer."""
    s = make_session(tiny, n_ctx=512, n_ubatch=1)
    created = (s.sched.buffer_sizes(), {k: a.reserves for k, a in s.sched.allocators.items()})
    s.decode(Batch.of_sequence(TINY_PROMPT[:6], 0))
    s.seq_add(0, 2, -1, 3)
    s.decode(Batch.of_sequence([65], 9))
    assert_buffers_unchanged(s, created)


# ---- debug lines ------------------------------------------------------------------------------------

def graph_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("graph: ")]


def test_debug_1_one_line_per_micro_batch_with_the_reason(tiny, monkeypatch, capsys):
    """20 tokens with -ub 8 run as 8, 8, 4: the last micro-batch rebuilds and says which shapes changed."""
    monkeypatch.setenv("GGRUN_GRAPH_DEBUG", "1")
    s = make_session(tiny, n_ctx=64, n_ubatch=8)
    capsys.readouterr()
    s.decode(Batch.of_sequence(TINY_PROMPT, 0))
    s.decode(Batch.of_sequence([65], 20))
    s.decode(Batch.of_sequence([66], 21))
    lines = graph_lines(capsys.readouterr().err)
    assert lines == [
        "graph: rebuilt: first graph (n_tokens 8, n_outputs 0, n_kv 64)",
        "graph: reused (n_tokens 8, n_outputs 0, n_kv 64)",
        "graph: rebuilt: n_tokens 8 -> 4, n_outputs 0 -> 1 (n_tokens 4, n_outputs 1, n_kv 64)",
        "graph: rebuilt: n_tokens 4 -> 1 (n_tokens 1, n_outputs 1, n_kv 64)",
        "graph: reused (n_tokens 1, n_outputs 1, n_kv 64)",
    ]


DEBUG2 = re.compile(r"^graph: (reused|rebuilt: [^(]+) \(n_tokens (\d+), n_outputs (\d+), n_kv (\d+)\) "
                    r"nodes (\d+) splits (\d+) buffers \[CPU (\d+\.\d\d) MiB\] "
                    r"build (\d+\.\d\d) ms plan (\d+\.\d\d) ms compute (\d+\.\d\d) ms$")


def test_debug_2_adds_nodes_splits_buffers_and_times(tiny, monkeypatch, capsys):
    monkeypatch.setenv("GGRUN_GRAPH_DEBUG", "2")
    s = make_session(tiny, n_ctx=64, n_ubatch=8)
    capsys.readouterr()
    s.decode(Batch.of_sequence(TINY_PROMPT, 0))
    nodes = len(s.result.sg.graph.nodes)
    s.decode(Batch.of_sequence([65], 20))
    s.decode(Batch.of_sequence([66], 21))
    lines = graph_lines(capsys.readouterr().err)
    assert len(lines) == 5, lines  # still one line per micro-batch
    fields = [DEBUG2.match(line) for line in lines]
    assert all(fields), lines
    mib = f"{s.sched.buffer_sizes()['CPU'] / 2**20:.2f}"
    assert {m.group(7) for m in fields} == {mib}
    assert int(fields[2].group(5)) == nodes and int(fields[2].group(6)) == 1
    for m in fields:
        if m.group(1) == "reused":
            assert float(m.group(8)) == float(m.group(9)) == 0.0
        assert float(m.group(10)) > 0.0


def test_reuse_off_by_env_and_by_parameter(tiny, monkeypatch):
    def built_reused(s: Session) -> tuple[int, int]:
        generate(s, TINY_PROMPT[:5], 8, Sampler(GREEDY), lambda t: None, ignore_eos=True)
        return s.stats.graphs_built, s.stats.graphs_reused

    assert built_reused(make_session(tiny, 64)) == (2, 6)
    assert built_reused(make_session(tiny, 64, reuse=False)) == (8, 0)
    monkeypatch.setenv("GGRUN_GRAPH_REUSE", "0")
    assert built_reused(make_session(tiny, 64)) == (8, 0)


def test_cli_run_reports_graphs_reused(tiny_llama_path, monkeypatch):
    from typer.testing import CliRunner

    from ggrun.cli.app import _register_commands, app

    _register_commands()
    args = ["run", "-m", str(tiny_llama_path), "-p", "hello world", "-n", "8", "--temp", "0", "-c", "64",
            "--ignore-eos"]
    on = CliRunner().invoke(app, args)
    off = CliRunner().invoke(app, args + ["--no-graph-reuse"])
    monkeypatch.setenv("GGRUN_GRAPH_REUSE", "0")
    env_off = CliRunner().invoke(app, args)
    for r in (on, off, env_off):
        assert r.exit_code == 0, r.output
    assert re.search(r"graphs reused = +6 \(built 2\)", on.stderr)
    assert re.search(r"graphs reused = +0 \(built 8\)", off.stderr)
    assert re.search(r"graphs reused = +0 \(built 8\)", env_off.stderr)
    assert on.stdout == off.stdout == env_off.stdout


# ---- invalidation: a changed KV layout or a reset scheduler forces a rebuild ------------------------

def decode_history(s: Session, steps: list[tuple[list[int], int]]) -> list[np.ndarray]:
    return [s.decode(Batch.of_sequence(toks, pos)) for toks, pos in steps]


HISTORY = [(TINY_PROMPT[:12], 0), ([65], 12), ([66], 13)]


def test_seq_rm_keeps_the_graph(tiny):
    """Removing positions 8.. frees cells 8..13. Decoding from 8 again has the kept graph's shapes and
    reuses it (which cells a token sees is the mask, input data); its logits equal reuse off bitwise
    and a session that never saw the removed tokens within 1e-4."""
    after = [([70], 8), ([71], 9)]
    got, sessions = {}, {}
    for reuse in (True, False):
        s = sessions[reuse] = make_session(tiny, 64, reuse=reuse)
        decode_history(s, HISTORY)
        kept = s.result
        s.seq_rm(0, 8, -1)
        got[reuse] = decode_history(s, after)
        assert (s.result is kept) == reuse
    log = sessions[True].stats.reuse_log
    assert log[-2:] == [(True, "reused"), (True, "reused")]
    assert all(np.array_equal(a, b) for a, b in zip(got[True], got[False]))
    want = decode_history(make_session(tiny, 64), [(TINY_PROMPT[:8], 0)] + after)[1:]
    for g, w in zip(got[True], want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)


def rotate_pairs(x: np.ndarray, delta: np.ndarray, base: float) -> np.ndarray:
    """llama's RoPE (adjacent pairs) of x [cells, heads, head_dim] by per-cell angles delta * base^(-2i/d)."""
    d = x.shape[-1]
    theta = delta[:, None].astype(np.float64) * base ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.astype(np.float64).copy()
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def test_seq_add_shifts_keys_and_forces_a_rebuild(tiny):
    """Context shift: drop positions 0..3 and move 4..11 down by 4. The K-shift graph re-rotates every
    layer's keys by -4 (checked against an independent rotation, and for layer 0, whose keys depend
    only on token and position, against a fresh evaluation at the new positions); the next decode
    rebuilds because the layout changed, and generation goes on."""
    hp = tiny.hp
    s = make_session(tiny, 64)
    decode_history(s, [(TINY_PROMPT[:12], 0), ([65], 12)])
    cpu = s.sched.cpu
    shape = (64, hp.n_head_kv, hp.head_dim)
    before = [cpu.array(L.k).reshape(shape)[:12].astype(np.float32) for L in s.kv.layers.values()]
    kept = s.result
    s.seq_rm(0, 0, 4)
    s.seq_add(0, 4, -1, -4)
    s.decode(Batch.of_sequence([66], 9))
    assert s.stats.reuse_log[-1] == (False, "rebuilt: KV cache layout changed") and s.result is not kept
    after = [cpu.array(L.k).reshape(shape)[4:12].astype(np.float32) for L in s.kv.layers.values()]
    for il in range(hp.n_layer):
        want = rotate_pairs(before[il][4:12], np.full(8, -4), hp.rope_freq_base)
        np.testing.assert_allclose(after[il], want, atol=4e-3, rtol=2e-3, err_msg=f"layer {il}")
    fresh = make_session(tiny, 64)
    decode_history(fresh, [(TINY_PROMPT[4:12], 0)])
    layer0 = cpu.array(fresh.kv.layers[0].k).reshape(shape)[:8].astype(np.float32)
    np.testing.assert_allclose(after[0], layer0, atol=4e-3, rtol=2e-3)
    assert s.kv.pos[4:13].tolist() == list(range(9)) and s.kv.pos[0] == 9
    logits = decode_history(s, [([67], 10), ([68], 11)])
    assert s.stats.reuse_log[-2:] == [(True, "reused"), (True, "reused")]
    assert all(np.isfinite(x).all() for x in logits)


def test_clear_keeps_the_graph(tiny):
    """After a clear (llama-bench between repetitions, perplexity between chunks) the kept graph serves
    again, and computes what a fresh session computes."""
    s = make_session(tiny, 64)
    decode_history(s, HISTORY)
    kept = s.result
    s.clear()
    got = s.decode(Batch.of_sequence([65], 0))
    assert s.stats.reuse_log[-1] == (True, "reused") and s.result is kept
    assert np.array_equal(got, make_session(tiny, 64).decode(Batch.of_sequence([65], 0)))


def test_reset_scheduler_never_runs_the_stale_graph(tiny):
    """After reset_scheduler the kept graph's tensors still point into the released buffer; the next
    decode builds a new GraphResult, the old graph is never computed again, and the logits equal a
    fresh session's."""
    s = make_session(tiny, 64)
    decode_history(s, HISTORY)
    stale = s.result
    old_buf = s.sched.allocators["CPU"].buffer
    created = s.sched.buffer_sizes()
    s.reset_scheduler()
    new_buf = s.sched.allocators["CPU"].buffer
    assert new_buf is not old_buf and s.sched.buffer_sizes() == created
    placed = [t for t in stale.sg.order if id(t) in stale.sg.owned["CPU"]]
    assert placed and all(t.buffer is old_buf for t in placed)  # stale: planned into released memory
    assert decide(stale.params, stale, stale, s.kv_version, s.sched.generation).why == "scheduler was reset"

    computed = []
    compute = s.sched.compute
    s.sched.compute = lambda sg: (computed.append(sg), compute(sg))[1]
    got = decode_history(s, [([70], 14), ([71], 15)])
    assert all(sg is not stale.sg for sg in computed) and len(computed) == 2
    assert s.result is not stale
    assert all(t.buffer is new_buf for t in s.result.sg.order if id(t) in s.result.sg.owned["CPU"])
    assert s.stats.reuse_log[-2:] == [(False, "rebuilt: scheduler was reset"), (True, "reused")]
    fresh = make_session(tiny, 64)
    want = decode_history(fresh, HISTORY + [([70], 14), ([71], 15)])[-2:]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_inputs_are_filled_where_the_current_plan_put_them(tiny):
    """set_inputs finds its inputs' arrays once per plan: kept while the graph is reused, found again when
    the same graph is planned anew (here into a new buffer), so it never fills memory a plan left."""
    s = make_session(tiny, 64)
    decode_history(s, HISTORY)
    res, cpu = s.result, s.sched.cpu
    resolved = res._input_arrays(cpu)
    decode_history(s, [([67], 14)])
    assert s.result is res and res._input_arrays(cpu) is resolved
    s.sched.reset()
    s.sched.alloc(res.sg)
    new_buf = s.sched.allocators["CPU"].buffer
    ub = split_batch(Batch.of_sequence([68], 15), 512)[0]
    res.set_inputs(s.place_ubatch(ub), cpu)
    assert res._input_arrays(cpu) is not resolved
    for inp, (_, arr) in zip(res.inputs, res._input_arrays(cpu)):
        assert inp.tensor.buffer is new_buf and np.shares_memory(arr, cpu.array(inp.tensor))
    assert cpu.array(res.inputs[0].tensor).tolist() == [68]


def test_an_input_that_cannot_serve_blocks_reuse(tiny):
    """Equal params, same cache and scheduler, but an input that cannot serve them: not reused (its answer
    is asked once, since it depends on the params alone)."""
    s = make_session(tiny, 64)
    decode_history(s, HISTORY)
    kept = s.result
    asked = []
    refusing = type("Refusing", (), {"can_reuse": lambda self, p: asked.append(p) or False})()
    res = GraphResult(kept.params, kept.inputs + [refusing], kept.logits, kept.sg, kept.kv_version,
                      kept.sched_generation)
    for _ in range(2):
        assert decide(kept.params, res, res, s.kv_version, s.sched.generation).why == "an input cannot be reused"
    assert asked == [kept.params]


def test_decide_says_reuse_or_rebuild_and_why():
    """graph_reuse.decide, the one rule: each condition in its order, on graph records alone (no model)."""
    p = GraphParams(1, 1, 256)
    kept = GraphResult(p, [], None, None, (3,), 7)
    prompt = GraphResult(GraphParams(6, 1, 256), [], None, None, (3,), 7)
    assert decide(p, None, None, (3,), 7) == Decision(False, "first graph")
    assert decide(p, kept, kept, (3,), 7, enabled=False).said == "rebuilt: graph reuse disabled"
    assert decide(p, None, prompt, (3,), 7).said == "rebuilt: n_tokens 6 -> 1"  # the last graph's, then p's
    assert decide(p, None, kept, (3,), 7).why == "not kept"
    assert decide(p, kept, prompt, (3,), 7) is REUSED and REUSED.said == "reused"
    assert decide(p, kept, kept, (4,), 7).why == "KV cache layout changed"
    assert decide(p, kept, kept, (3,), 8).why == "scheduler was reset"
