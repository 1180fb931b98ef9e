"""Decode steps of many sequences on the GPU: the per-token attention kernel (attn_decode_tok, each token over
its own sequence's cells) gives the CPU's logits; steps are padded to power-of-two buckets whose graphs are
captured as CUDA graphs once each, re-captured on a bucket change only (GGRUN_GRAPH_DEBUG shows both).
Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import require_gpu

cupy = require_gpu()

from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.backends.cuda.binding import launches_of  # noqa: E402
from ggrun.core.backends.cuda.module import kernel  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402

# head_dim 64 (a size the decode kernels are built for), four query heads per KV head
SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=1, n_ff=256)


def _session(path, backends, ngl) -> Session:
    m = Model.load(path, backends, ngl, numerics="f32")
    return Session(m, SessionParams(n_ctx=1024, n_batch=512, n_ubatch=512, n_seq_max=16))


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
        assert np.array_equal(g.argmax(axis=1), c.argmax(axis=1))


def test_buckets_are_captured_once_and_recaptured_on_a_bucket_change(tiny_llama_factory, monkeypatch, capfd):
    monkeypatch.setenv("GGRUN_GRAPH_DEBUG", "1")
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
