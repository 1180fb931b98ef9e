"""generate() at the context's end on a synthetic tiny llama: it stops and says so, or with context_shift
keeps the first n_keep tokens, discards half of the rest and goes on (llama.cpp's context shift); `run`
prints a notice for the first and counts the shifts of the second. Interrupted sessions end generation
with what exists."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.generate import (STOP_CONTEXT_FULL, STOP_INTERRUPTED, STOP_N_PREDICT, PromptTable, common_prefix,
                                     generate, keep_for_shift)
from ggrun.core.llm.model import Model
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams
from tests.cli.runner import ggrun
from tests.cli.test_cli_run import timings

PROMPT = [104, 101, 108, 108, 111, 256, 263, 32, 119]


@pytest.fixture(scope="module")
def model(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


def session(model: Model, n_ctx: int, n_ubatch: int = 512) -> Session:
    return Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch))


def expected_shifts(n_prompt: int, n_predict: int, n_ctx: int, n_keep: int) -> list[int]:
    """The tokens each shift discards, replaying llama.cpp's rule: the token sampled at `pos` == n_ctx
    (every cell used) needs room, so half of what follows the kept tokens goes."""
    pos, shifts = n_prompt, []
    for i in range(n_predict - 1):  # the last token is sampled, never decoded
        if pos >= n_ctx:
            discard = (pos - n_keep) // 2
            shifts.append(discard)
            pos -= discard
        pos += 1
    return shifts


def test_without_context_shift_a_full_context_stops(model):
    out, st = generate(session(model, 16), PROMPT, 40, Sampler(SamplingParams(temp=0)), lambda t: None,
                       ignore_eos=True)
    assert len(out) == 16 - len(PROMPT) + 1 and st.stop_reason == STOP_CONTEXT_FULL and st.n_shifts == 0


@pytest.mark.parametrize("n_keep", [0, 4, len(PROMPT)])
def test_context_shift_keeps_the_first_tokens_and_goes_on(model, n_keep):
    """40 tokens through a 16-cell context: every shift discards the expected count; afterwards the kept
    tokens still sit in their cells at positions 0..n_keep-1 and the positions in use are 0..pos-1 without
    gaps (the discarded ones moved the rest down, as the K-shift re-rotated them)."""
    s = session(model, 16)
    kept_cells = None

    def on_token(t: int) -> None:
        nonlocal kept_cells
        if kept_cells is None:
            kept_cells = [int(np.flatnonzero(s.kv.pos == p)[0]) for p in range(n_keep)]

    out, st = generate(s, PROMPT, 40, Sampler(SamplingParams(temp=0)), on_token, ignore_eos=True,
                       context_shift=True, n_keep=n_keep)
    shifts = expected_shifts(len(PROMPT), 40, 16, n_keep)
    assert len(out) == 40 and st.stop_reason == STOP_N_PREDICT
    assert (st.n_shifts, st.n_discarded) == (len(shifts), sum(shifts)) and st.n_shifts >= 3
    assert st.n_eval == 39
    used = np.sort(s.kv.pos[s.kv.pos >= 0])
    assert used.tolist() == list(range(len(used))) and len(used) <= 16
    assert [int(np.flatnonzero(s.kv.pos == p)[0]) for p in range(n_keep)] == kept_cells
    assert s.stats.reuse_log.count((False, "rebuilt: KV cache layout changed")) >= st.n_shifts


def test_a_keep_that_leaves_nothing_to_discard_stops(model):
    """With --keep covering all but one cell, a shift would discard nothing: generation stops there."""
    prompt = PROMPT + PROMPT[:6]
    out, st = generate(session(model, 16), prompt, 40, Sampler(SamplingParams(temp=0)), lambda t: None,
                       ignore_eos=True, context_shift=True, n_keep=15)
    assert st.stop_reason == STOP_CONTEXT_FULL and st.n_shifts == 0 and len(out) == 16 - 15 + 1


def test_shifted_generation_matches_a_fresh_sequence_on_its_first_layer_keys(model):
    """After a shift the kept and moved tokens' layer-0 keys are those a fresh evaluation of the same
    tokens at their new positions gives (layer 0's keys depend only on token and position)."""
    s = session(model, 16)
    history: list[int] = list(PROMPT)
    out, st = generate(s, PROMPT, 8 + 1, Sampler(SamplingParams(temp=0)), history.append, ignore_eos=True,
                       context_shift=True, n_keep=2)
    assert st.n_shifts == 1  # 9 + 8 > 16: one shift of (16 - 2) // 2 = 7 tokens, then the 9th token
    kept = history[:2] + history[2 + 7:17]  # the tokens at positions 0..9 after the shift
    hp = model.hp
    cpu = s.sched.cpu
    shape = (16, hp.n_head_kv, hp.head_dim)
    k = cpu.array(s.kv.layers[0].k).reshape(shape).astype(np.float32)
    by_pos = {int(p): c for c, p in enumerate(s.kv.pos) if p >= 0}
    fresh = session(model, 16)
    fresh.decode(Batch.of_sequence(kept, 0))
    k_fresh = cpu.array(fresh.kv.layers[0].k).reshape(shape).astype(np.float32)
    for p in range(len(kept)):
        np.testing.assert_allclose(k[by_pos[p]], k_fresh[p], atol=4e-3, rtol=2e-3, err_msg=f"position {p}")


def test_interrupted_session_ends_generation_with_what_exists(model):
    s = session(model, 64)
    streamed: list[int] = []
    s.interrupt = lambda: len(streamed) >= 3
    out, st = generate(s, PROMPT, 20, Sampler(SamplingParams(temp=0)), streamed.append, ignore_eos=True)
    assert out == streamed and len(out) == 3
    assert st.stop_reason == STOP_INTERRUPTED and st.n_eval == 2 and st.n_prompt == len(PROMPT)


def test_interrupted_prompt_reports_the_tokens_evaluated(model):
    s = session(model, 64, n_ubatch=4)
    s.interrupt = lambda: s.stats.n_tokens >= 4
    out, st = generate(s, PROMPT, 20, Sampler(SamplingParams(temp=0)), lambda t: None)
    assert out == [] and st.stop_reason == STOP_INTERRUPTED and st.n_prompt == 4


@pytest.mark.parametrize("n_keep, prompt, add_bos, want", [
    (0, [1, 5, 6], False, 0), (0, [1, 5, 6], True, 1), (2, [1, 5, 6], True, 3), (2, [5, 6, 7, 8], False, 2),
    (-1, [5, 6, 7], False, 3), (10, [5, 6, 7], True, 3), (3, [1, 5, 6], True, 3),
])
def test_keep_follows_llama_cpp(n_keep, prompt, add_bos, want):
    assert keep_for_shift(n_keep, prompt, add_bos) == want


# ---- through the CLI ---------------------------------------------------------------------------------


def test_run_says_when_the_context_is_full(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "Once upon a time", "-n", "200",
                           "-c", "32", "--ignore-eos", "--temp", "0")
    assert code == 0, err
    notice = [line for line in err.splitlines() if "context full" in line]
    assert len(notice) == 1 and "(-c 32)" in notice[0] and "--context-shift" in notice[0], err
    n_total = int(timings(err)["total time"].split("/")[1].split()[0])
    assert n_total == 32  # tokens evaluated, as llama.cpp counts them (prompt and decode runs): every cell


def test_run_with_context_shift_keeps_going(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "Once upon a time", "-n", "200",
                           "-c", "32", "--ignore-eos", "--temp", "0", "--context-shift", "--keep", "2")
    assert code == 0, err
    assert "context full" not in err
    found = timings(err)
    n_prompt = int(found["prompt eval time"].split("/")[1].split()[0])
    shifts = expected_shifts(n_prompt, 200, 32, 2)
    assert f"context shifted {len(shifts)} times, {sum(shifts)} tokens discarded (--keep 2)" in err
    assert int(found["total time"].split("/")[1].split()[0]) == n_prompt + 199  # the last token is never decoded
    assert int(found["eval time"].split("/")[1].split()[0]) == 199


def test_run_rejects_a_negative_keep(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "--keep", "-2")
    assert code == 2 and err.startswith("error: --keep -2") and out == ""


# ---- a sequence kept between calls (conversation turns) ------------------------------------------------


def test_extend_evaluates_only_the_new_tokens_and_matches_a_fresh_run(model):
    """Two turns through Generation.extend: the second decodes only its own tokens (and the token sampled
    last), and its logits equal those of one session that evaluates the whole sequence at once."""
    from ggrun.core.llm.generate import Generation

    s = session(model, 64)
    g = Generation(s, Sampler(SamplingParams(temp=0)))
    st = g.extend(PROMPT)
    out, _ = g.generate(4, lambda t: None, ignore_eos=True)
    st2 = g.extend([119, 111, 114])
    assert (st.n_prompt, st.n_reused) == (len(PROMPT), 0)
    assert (st2.n_prompt, st2.n_reused) == (1 + 3, len(PROMPT) + 3)
    fresh = Generation(session(model, 64), Sampler(SamplingParams(temp=0)))
    fresh.extend(g.tokens)
    np.testing.assert_allclose(g.logits, fresh.logits, atol=2e-2)


@pytest.mark.parametrize("back_to, reused", [(34, True), (33, False), (20, False)])
def test_going_back_over_a_sliding_window_starts_again(tmp_path, back_to, reused):
    """gemma3's window cache (window 8) drops keys no later token can see: after decoding position 34,
    positions up to 26 are gone. Keeping a prefix of 34 is fine (its next token sees 27..34); keeping 33
    or 20 would need dropped keys, so the sequence is evaluated from the start. Either way the logits
    are those of a fresh evaluation."""
    from ggrun.core.llm.generate import Generation
    from ggrun.loaders.synthetic import write_tiny_gemma3

    m = Model.load(write_tiny_gemma3(tmp_path / "g.gguf", sliding_window=8), [CPUBackend()])
    prompt = [97 + i % 26 for i in range(30)]
    g = Generation(Session(m, SessionParams(n_ctx=64)), Sampler(SamplingParams(temp=0)))
    g.extend(prompt)
    g.generate(6, lambda t: None, ignore_eos=True)  # decodes positions 30..34
    tokens = g.tokens[:back_to] + [120, 121]
    st = g.set_tokens(tokens)
    assert st.n_reused == (back_to if reused else 0)
    fresh = Generation(Session(m, SessionParams(n_ctx=64)), Sampler(SamplingParams(temp=0)))
    fresh.extend(tokens)
    np.testing.assert_allclose(g.logits, fresh.logits, atol=2e-2)


def test_prompt_table_gives_each_slots_common_prefix():
    """PromptTable.common is common_prefix against every slot's prompt: shorter, longer, equal, empty and rewritten
    prompts, and prompts past the table's first width."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 5, 200).astype(np.int32)
    prompts = [base[:10], base[:150], base, np.r_[base[:40], [7, 7]], np.zeros(0, np.int32), base[:3]]
    table = PromptTable(len(prompts))
    for i, p in enumerate(prompts):
        table.set(i, p)
    table.set(5, base[:120])  # a slot's next prompt replaces its last, shorter or longer
    prompts[5] = base[:120]
    table.set(5, base[:30])
    prompts[5] = base[:30]
    for ids in (base, base[:50], np.r_[base[:60], [9]], base[:1], np.r_[[9], base]):
        want = [common_prefix(p, ids) for p in prompts]
        assert table.common(ids).tolist() == want
