"""Decode steps of many sequences on the GPU: the per-token attention kernel (attn_decode_tok, each token over
its own sequence's cells) gives the CPU's logits; steps are padded to power-of-two buckets whose graphs are
captured as CUDA graphs once each, re-captured on a bucket change only (GGRUN_GRAPH_DEBUG shows both). The
KQ mask made on the device from the cells (ops.kq_mask) is the reference kernel's, bit for bit, and a session
whose masks are made so decodes as one that fills them on the host. Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import require_gpu

cupy = require_gpu()

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.backends.cuda.binding import launches_of  # noqa: E402
from ggrun.core.backends.cuda.module import kernel  # noqa: E402
from ggrun.core.backends.op_harness import ReferenceBackend, planned, run_on  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402
from ggrun.core.llm import graph_reuse  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402

# head_dim 64 (a size the decode kernels are built for), four query heads per KV head
SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=1, n_ff=256)


def _session(path, backends, ngl, mask_from_cells: bool | None = None) -> Session:
    m = Model.load(path, backends, ngl, numerics="f32")
    return Session(m, SessionParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_seq_max=16,
                                    mask_from_cells=mask_from_cells))


def _prompts(s: Session, n_seq: int, rng) -> list[int]:
    """A prompt of its own length for each sequence, decoded sequence by sequence; each one's next position."""
    pos = []
    for q in range(n_seq):
        n = int(rng.integers(3, 40))
        s.decode(Batch.of_sequence(rng.integers(1, 200, n).tolist(), 0, q, last_logits=True))
        pos.append(n)
    return pos


def _step(n_seq: int, pos: list[int], rng) -> Batch:
    """One token of each of n_seq sequences, every row asking logits."""
    return Batch(rng.integers(1, 200, n_seq).astype(np.int32), np.array(pos[:n_seq], dtype=np.int32),
                 np.arange(n_seq, dtype=np.int32), np.ones(n_seq, dtype=bool))


def test_many_sequences_decode_as_on_the_cpu(tiny_llama_factory):
    path = tiny_llama_factory(**SHAPE)
    gpu = CUDABackend(0)
    logits = {}
    for name, backends, ngl in (("gpu", [gpu, CPUBackend()], 99), ("cpu", [CPUBackend()], 0)):
        s, rng = _session(path, backends, ngl), np.random.default_rng(0)
        pos = _prompts(s, 12, rng)
        out = []
        for _ in range(6):
            out.append(s.decode(_step(12, pos, rng)).copy())
            pos = [p + 1 for p in pos]
        logits[name] = out
        if name == "gpu":
            tok = kernel("attention.cu", "attn_decode_tok<1, 64>")
            used = [la.kernel for sp in s.result.sg.splits if sp.backend is gpu
                    for la in launches_of(sp.calls.steps) if la is not None]
            assert any(k is tok for k in used), "the per-token decode attention did not run"
    for g, c in zip(logits["gpu"], logits["cpu"]):  # measured on an H200: at most 6e-3 apart over the 6 steps
        np.testing.assert_allclose(g, c, rtol=0, atol=1e-2)
        # the same top token wherever the CPU's best two are further apart than the two runs may be: 72 rows
        # of a random tiny model's logits hold near-ties, which 6e-3 can order either way
        top2 = np.sort(c, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2e-2
        assert np.array_equal(g.argmax(axis=1)[clear], c.argmax(axis=1)[clear])


def test_buckets_are_captured_once_and_recaptured_on_a_bucket_change(tiny_llama_factory, monkeypatch, capfd):
    """Each bucket's own graph (no lending of a larger kept graph: BORROW_USES 0, as graph_reuse's tests cover
    lending) is captured on its second run and replayed after."""
    monkeypatch.setenv("GGRUN_GRAPH_DEBUG", "1")
    monkeypatch.setattr(graph_reuse, "BORROW_USES", 0)
    path = tiny_llama_factory(**SHAPE)
    s, rng = _session(path, [CUDABackend(0), CPUBackend()], 99), np.random.default_rng(1)
    pos = _prompts(s, 8, rng)
    s.decode_greedy(_step(8, pos, rng))  # every sequence's cells placed: the cache's span stays as it is
    pos = [p + 1 for p in pos]
    capfd.readouterr()
    captures = []
    for n_seq in (3, 3, 3, 4, 4, 5, 5, 5, 3, 3):  # buckets 4 (a new graph), 4, 4, 4, 4, 8 (run once above), 8, 8, 4, 4
        s.decode_greedy(_step(n_seq, pos, rng))
        pos = [p + 1 if i < n_seq else p for i, p in enumerate(pos)]
        captures.append(capfd.readouterr().err.count("cuda graph: captured"))
    # a graph runs eagerly first, is captured on its second run and replayed after; a bucket's kept graph
    # comes back captured
    assert captures == [0, 1, 0, 0, 0, 1, 0, 0, 0, 0], captures
    s.decode_greedy(_step(5, pos, rng))
    assert "bucket 8 (5 + 3 padding)" in capfd.readouterr().err


@pytest.mark.parametrize("window", [0, 9])
def test_kq_mask_kernel_is_the_reference(window):
    """ops.kq_mask's CUDA kernel: 70 sequences (three words of bits a cell), shared and free cells, a padding
    row (sequence -1), with and without a window: the reference kernel's mask, bit for bit, from a kernel that
    a CUDA graph can capture."""
    gen = np.random.default_rng(window)
    n_kv, n_seq, n_tok = 512, 70, 40
    cell_pos = np.where(gen.random(n_kv) < 0.8, gen.integers(0, 60, n_kv), -1).astype(np.int32)
    bits = np.zeros((n_kv, 96), dtype=bool)
    bits[np.arange(n_kv), gen.integers(0, n_seq, n_kv)] = cell_pos >= 0
    bits[::7, gen.integers(0, n_seq)] = True
    cell_seqs = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    tok_pos = gen.integers(0, 64, n_tok).astype(np.int32)
    tok_seq = gen.integers(0, n_seq, n_tok).astype(np.int32)
    tok_seq[-1] = -1

    def build(leafs):
        return ops.kq_mask(leafs.input("cell_pos", DType.I32, cell_pos), leafs.input("cell_seqs", DType.I32, cell_seqs),
                           leafs.input("tok_pos", DType.I32, tok_pos), leafs.input("tok_seq", DType.I32, tok_seq),
                           window or None)

    gpu = CUDABackend(0)
    got, want = run_on(gpu, build), run_on(ReferenceBackend(), build)
    assert np.array_equal(got, want) and 0 < np.count_nonzero(want == 0) < want.size  # neither all shown nor all hidden
    _, sg, _, _ = planned(gpu, build)
    assert all(step.capturable for step in gpu.prepare(sg.splits[0].nodes).steps)


def test_masks_from_cells_decode_as_host_masks_on_the_gpu(tiny_llama_factory):
    """Prompts of 12 sequences in one batch, then decode steps of all of them (a bucket of 16): a GPU session
    whose masks are made from the cells gives the logits of one whose masks the host fills, finite."""
    path = tiny_llama_factory(**SHAPE)
    logits = {}
    for from_cells in (True, False):
        s, rng = _session(path, [CUDABackend(0), CPUBackend()], 99, from_cells), np.random.default_rng(2)
        assert (s.seq_words > 0) == from_cells
        lens = rng.integers(3, 40, 12)
        b = Batch()
        for q, n in enumerate(lens):
            for i, tok in enumerate(rng.integers(1, 200, n)):
                b.add(int(tok), i, q, i == n - 1)
        out = [s.decode(b).copy()]
        pos = [int(n) for n in lens]
        for _ in range(4):
            out.append(s.decode(_step(12, pos, rng)).copy())
            pos = [p + 1 for p in pos]
        logits[from_cells] = out
    for got, want in zip(logits[True], logits[False]):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
