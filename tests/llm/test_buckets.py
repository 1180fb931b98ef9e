"""Decode steps of many sequences: padded to power-of-two buckets (core/llm/buckets.py), so the graph of a
bucket is reused while sequences join and leave within it and rebuilt when the bucket changes (as
GGRUN_GRAPH_DEBUG says); padding rows change no real row's logits and take no cell; each sequence's
tokens go into blocks of cells of its own (core/llm/kv_blocks.py)."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.llm.batch import Batch, UBatch
from ggrun.core.llm import buckets, graph_reuse
from ggrun.core.llm.buckets import bucket_size, pad_mixed
from ggrun.core.llm.inputs import UBatchState
from ggrun.core.llm.kv_blocks import BLOCK, find_cells
from ggrun.core.llm.kv_cache import KVCache
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams

N_SEQ = 8


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()], numerics="f32")


def step(seqs: list[int], pos: list[int], tokens: list[int] | None = None) -> Batch:
    """One token of each of `seqs` at `pos`, all asking logits."""
    n = len(seqs)
    toks = tokens if tokens is not None else [(7 * s + p) % 200 + 1 for s, p in zip(seqs, pos)]
    return Batch(np.array(toks, np.int32), np.array(pos, np.int32), np.array(seqs, np.int32), np.ones(n, bool))


def test_bucket_sizes():
    assert [bucket_size(n, 512) for n in (1, 2, 3, 4, 5, 8, 9, 100, 129, 256)] == [1, 2, 4, 4, 8, 8, 16, 128, 256, 256]
    assert bucket_size(300, 300) == 300 and bucket_size(5, 6) == 6 and bucket_size(7, 4) == 7


def test_buckets_are_reused_within_and_rebuilt_across(tiny, monkeypatch, capsys):
    """3 and 4 sequences share bucket 4, 5..8 share bucket 8; joining within a bucket reuses its graph."""
    monkeypatch.setenv("GGRUN_GRAPH_DEBUG", "1")
    s = Session(tiny, SessionParams(n_ctx=512, n_seq_max=N_SEQ))
    capsys.readouterr()
    pos = [0] * N_SEQ
    lines = []
    for n in (3, 4, 3, 5, 8, 6, 3):
        seqs = list(range(n))
        s.decode(step(seqs, [pos[q] for q in seqs]))
        for q in seqs:
            pos[q] += 1
        lines.append(capsys.readouterr().err.strip().splitlines()[-1])
    assert "rebuilt" in lines[0] and "bucket 4 (3 + 1 padding)" in lines[0]
    assert "reused" in lines[1] and "n_tokens 4" in lines[1] and "padding" not in lines[1]
    assert "reused" in lines[2] and "bucket 4 (3 + 1 padding)" in lines[2]
    assert "rebuilt" in lines[3] and "n_tokens 4 -> 8" in lines[3] and "bucket 8 (5 + 3 padding)" in lines[3]
    assert "reused" in lines[4] and "reused" in lines[5] and "bucket 8 (6 + 2 padding)" in lines[5]
    assert "rebuilt" in lines[6] and "n_tokens 8 -> 4" in lines[6]


def test_a_smaller_bucket_runs_a_kept_larger_graph_until_it_recurs(tiny, monkeypatch):
    """Where masks are made from the cells (a GPU session of many sequences), a decode step of 4 sequences runs
    the kept graph of bucket 8 (lent, padded with 4 more rows) BORROW_USES times, then gets its own; a step of 2
    sequences does not (more than twice its rows). Each step's logits are those of a session that never lends (f32
    numerics)."""
    monkeypatch.setattr(graph_reuse, "BORROW_USES", 3)

    def run(from_cells: bool):
        s = Session(tiny, SessionParams(n_ctx=512, n_seq_max=N_SEQ, mask_from_cells=from_cells))
        s.decode(step(list(range(8)), [0] * 8))
        sizes, outs = [], []
        for p in range(1, 7):
            seqs = [0, 1] if p == 1 else [0, 1, 2, 3]
            outs.append(s.decode(step(seqs, [p] * len(seqs))).copy())
            sizes.append(s.result.params.n_tokens)
        return sizes, outs

    sizes, got = run(True)
    plain, want = run(False)
    assert sizes == [2, 8, 8, 8, 4, 4] and plain == [2, 4, 4, 4, 4, 4]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5)


def test_padding_changes_no_real_row_and_takes_no_cell(tiny):
    """Five sequences decoded together (bucket 8) give each the logits it gets alone (f32 numerics), and the
    cache holds exactly their tokens afterwards."""
    prompts = [[3, 4, 5], [6, 7], [8], [9, 10, 11, 12], [13, 14]]
    together = Session(tiny, SessionParams(n_ctx=512, n_seq_max=N_SEQ))
    for q, p in enumerate(prompts):
        together.decode(Batch.of_sequence(p, 0, q))
    used = together.kv.n_used
    got = together.decode(step(list(range(5)), [len(p) for p in prompts]))
    assert got.shape == (5, tiny.hp.n_vocab)
    assert together.kv.n_used == used + 5
    assert together.result.params.n_tokens == 8
    for q, p in enumerate(prompts):
        alone = Session(tiny, SessionParams(n_ctx=512, n_seq_max=1))
        want = alone.decode(Batch.of_sequence(p + [step([q], [len(p)]).tokens[0]], 0))
        np.testing.assert_allclose(got[q], want[-1], atol=2e-5, rtol=0, err_msg=f"sequence {q}")


def test_decode_steps_keep_each_sequence_in_blocks_of_its_own(tiny):
    """Prompts and then decode steps of four sequences: every block of cells holds one sequence only."""
    s = Session(tiny, SessionParams(n_ctx=1024, n_seq_max=4))
    lens = [70, 5, 40, 1]
    batch = Batch()
    for q, n in enumerate(lens):
        for i in range(n):
            batch.add(1 + i % 50, i, q)
    s.decode(batch)
    pos = list(lens)
    for _ in range(30):
        s.decode(step([0, 1, 2, 3], pos))
        pos = [p + 1 for p in pos]
    used = np.flatnonzero(s.kv.pos >= 0)
    owner = s.kv.seqs[used].argmax(axis=1)
    for block in np.unique(used // BLOCK):
        assert len(np.unique(owner[used // BLOCK == block])) == 1, f"block {block} mixes sequences"
    for q in range(4):  # each sequence's positions are all there, once
        assert sorted(s.kv.pos[s.kv.seqs[:, q]].tolist()) == list(range(pos[q]))


def test_find_cells_falls_back_to_any_free_cell():
    """With no whole free block left, a sequence's new token takes the lowest free cell nobody took."""
    n = 3 * BLOCK
    pos = np.full(n, -1, np.int32)
    seqs = np.zeros((n, 3), bool)
    tail = np.full(3, -1, np.int32)
    for b, q in enumerate((0, 1)):  # blocks 0 and 1 full, block 2 holds one cell of sequence 0 at its start
        pos[b * BLOCK:(b + 1) * BLOCK] = np.arange(BLOCK)
        seqs[b * BLOCK:(b + 1) * BLOCK, q] = True
    pos[2 * BLOCK], seqs[2 * BLOCK, 0] = BLOCK, True
    tail[:] = [2 * BLOCK, BLOCK * 2 - 1, -1]
    cells = find_cells(pos, seqs, tail, np.array([0, 1, 2], np.int32))
    assert cells.tolist() == [2 * BLOCK + 1, 2 * BLOCK + 2, 2 * BLOCK + 3]
    pos[:] = 0
    assert find_cells(pos, seqs, tail, np.array([0], np.int32)) is None


def _mixed_steps(model: Model, from_cells: bool) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """Three sequences' prompts in one batch, then two steps where each decodes one token and a new sequence's
    prompt joins (5 tokens, then 4): the logits each batch gives and its graph's (n_tokens, n_outputs)."""
    s = Session(model, SessionParams(n_ctx=512, n_seq_max=N_SEQ, mask_from_cells=from_cells))
    b = Batch()
    for q, n in enumerate((4, 2, 3)):
        for i in range(n):
            b.add(10 * q + i + 1, i, q, i == n - 1)
    outs = [s.decode(b).copy()]
    shapes = [(s.result.params.n_tokens, s.result.params.n_outputs)]
    pos = [4, 2, 3]
    for new, n in ((3, 5), (4, 4)):
        b = Batch()
        for q in range(3):
            b.add(50 + q, pos[q], q, True)
            pos[q] += 1
        for i in range(n):
            b.add(90 + i, i, new, i == n - 1)
        outs.append(s.decode(b).copy())
        shapes.append((s.result.params.n_tokens, s.result.params.n_outputs))
    return outs, shapes


def test_mixed_steps_of_a_many_sequence_session_pad_to_powers_of_two(tiny):
    """Where masks are made from the cells (a GPU session of many sequences), three prompts (9 tokens, 3 outputs)
    are padded to 16 tokens and 4 outputs, and a step mixing decode tokens and a joining prompt (3 + 5 tokens,
    4 outputs) runs that graph, lent to it (GraphCache.borrow: up to twice its tokens); the next (3 + 4), whose
    new sequence's cells reach past 256 (n_kv 512), gets a graph of 8 tokens and 4 outputs. The real rows'
    logits are those of the unpadded session."""
    got, shapes = _mixed_steps(tiny, True)
    want, plain = _mixed_steps(tiny, False)
    assert shapes == [(16, 4), (16, 4), (8, 4)] and plain == [(9, 3), (8, 4), (7, 4)]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5)


@pytest.mark.parametrize("drawn, cases", [
    (False, ((40, 3, (64, 4)), (5, 1, (8, 1)), (9, 9, (16, 16)), (40, 0, (64, 0)))),
    (True, ((40, 3, (64, 16)), (5, 1, (8, 2)), (9, 9, (16, 16)), (40, 0, (64, 0)), (166, 4, (256, 64))))])
def test_mixed_outputs_pad_to_a_power_of_two(drawn, cases):
    """A mixed step's tokens and outputs pad to powers of two, the outputs by repeating the last (no more than
    the padded tokens): 40 tokens with 3 outputs are 64 with 4, 5 with 1 stay 8 with 1, 9 with 9 are 16 with 16.
    Where its tokens are drawn in the graph (its logits stay there), the outputs pad to a quarter of the tokens
    at least: 40 with 3 are 64 with 16, 5 with 1 are 8 with 2, 166 with 4 are 256 with 64."""
    for n, n_out, want in cases:
        kv = KVCache(256 if n < 256 else 512, 8, [], n_seq_max=4, pad=8)
        ub = UBatch(np.zeros(n, np.int32), np.arange(n, dtype=np.int32), np.zeros(n, np.int32),
                    np.arange(n - n_out, n, dtype=np.int32), 0)
        st = pad_mixed(UBatchState(ub, np.arange(n, dtype=np.int32), kv), 512, drawn)
        assert (st.ub.n_tokens, st.ub.n_outputs) == want
        assert st.ub.n_out_pad == want[1] - n_out and list(st.ub.out_rows[:n_out]) == list(range(n - n_out, n))


def test_steps_of_sequences_that_may_share_cells_are_marked_shared(tiny, monkeypatch):
    """A decode step of 32 sequences or more whose cache had cells copied between sequences (seq_cp: a shared
    system prompt) gets the graph that reads a shared prefix once for all (GraphParams.shared, the attention node
    marked shared_prefix); without a copy, or with fewer sequences (16), the graph of tokens read one by one;
    clearing the cache forgets the copies. Its logits are the unmarked graph's (the CPU attends token by token)."""
    n = 32
    s = Session(tiny, SessionParams(n_ctx=512, n_seq_max=n + 1))

    def run(copy: bool, seqs: int) -> tuple[bool, np.ndarray]:
        s.clear()
        s.decode(Batch.of_sequence([5, 6, 7], 0, n, last_logits=False))
        if copy:
            for q in range(seqs):
                s.seq_cp(n, q)
        out = s.decode(step(list(range(seqs)), [3] * seqs)).copy()
        marked = [t for t in s.result.sg.graph.nodes if t.params.get("shared_prefix")]
        assert bool(marked) == s.result.params.shared
        return s.result.params.shared, out

    shared, with_copy = run(True, n)
    assert shared
    assert run(False, n)[0] is False and run(True, 16)[0] is False
    s.clear()
    assert s.kv.copied is False
    monkeypatch.setattr(buckets, "SHARED_MIN_TOKENS", 1000)
    unmarked, plain = run(True, n)
    assert not unmarked
    np.testing.assert_array_equal(with_copy, plain)
