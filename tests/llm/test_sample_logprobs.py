"""ops.sample_logprobs (the log-probabilities of the drawn tokens and the likeliest ones, computed where the
logits are): the reference kernel and the compiled CPU kernel against a float64 log-softmax, and
Session.decode_sampled_logprobs against the logits of the same step."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cpu import sample as cpu_sample
from ggrun.core.backends.kernels import _sample_logprobs
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.batched_sampler import BatchedSampler
from ggrun.core.llm.model import Model
from ggrun.core.llm.sampling import SamplingParams
from ggrun.core.llm.session import Session, SessionParams


class _Node:
    def __init__(self, n_probs: int) -> None:
        self.params = {"n_probs": n_probs}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    s = x - x.max(axis=1, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("n_probs", [0, 1, 7])
def test_kernels_give_the_log_softmax_and_the_likeliest_tokens(n_probs):
    rng = np.random.default_rng(n_probs)
    x = (rng.standard_normal((9, 2000)) * 4).astype(np.float32)
    x[3, [10, 20]] = x[3].max() + 1  # a tie at the top: the lower id first
    ids = rng.integers(0, 2000, 9).astype(np.int32)
    ids[5] = -2  # a row ops.sample left to the host
    want = log_softmax(x)
    for compiled in (False, True):
        out = np.full((9, 1 + 2 * n_probs), 7.0, np.float32)
        if compiled:
            cpu_sample.logprobs_rows(x, ids, n_probs, out)
        else:
            _sample_logprobs(np, _Node(n_probs), out, [x, ids])
        ok = ids >= 0
        np.testing.assert_allclose(out[ok, 0], want[ok, ids[ok]], rtol=0, atol=1e-5)
        assert np.isnan(out[5, 0])
        if n_probs:
            top = np.argsort(-x, axis=1, kind="stable")[:, :n_probs]
            np.testing.assert_array_equal(out[:, 1::2], top.astype(np.float32))
            np.testing.assert_allclose(out[:, 2::2], np.take_along_axis(want, top, axis=1), rtol=0, atol=1e-5)
            assert out[3, 1] == 10 and (n_probs < 2 or out[3, 3] == 20)


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


def test_decode_sampled_logprobs_match_the_steps_logits(tiny):
    """The same seeds draw the same ids as decode_sampled, and the reported values are the log-softmax of the
    logits that step computed (decode_sampled's with_logits) at those ids and at the likeliest tokens."""
    settings = [SamplingParams(seed=s, temp=0.9) for s in range(3)]
    runs = {}
    for kind in ("logits", "logprobs"):
        s = Session(tiny, SessionParams(n_ctx=128, n_seq_max=3))
        batched = BatchedSampler(settings, 128)
        for i, p in enumerate([[5, 6, 7], [9, 10], [11, 12, 13, 14]]):
            s.decode(Batch.of_sequence(p, 0, i))
        batch = Batch(np.array([7, 10, 14], np.int32), np.array([3, 2, 4], np.int32), np.arange(3, dtype=np.int32),
                      np.ones(3, bool))
        rows = batched.rows(np.arange(3))
        runs[kind] = (s.decode_sampled(batch, rows, with_logits=True) if kind == "logits"
                      else s.decode_sampled_logprobs(batch, rows, n_probs=4))
    (ids, logits), (ids2, lp) = runs["logits"], runs["logprobs"]
    assert ids.tolist() == ids2.tolist() and lp.shape == (3, 9)
    want = log_softmax(logits)
    np.testing.assert_allclose(lp[:, 0], want[np.arange(3), ids], rtol=0, atol=1e-5)
    top = np.argsort(-logits, axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(lp[:, 1::2], top)


def test_rows_a_kernel_leaves_to_the_host_are_drawn_there(tiny, monkeypatch):
    """A kernel may mark a row ops.SAMPLE_ON_HOST (the GPU's, beyond the candidates it sorts): the session then
    draws that row from its logits with the same draw, so the ids equal an unmarked run's, and its
    log-probability is filled in on the host."""
    from ggrun.core import ops

    settings = [SamplingParams(seed=s, temp=0.8, top_k=0) for s in range(3)]

    def run() -> tuple[np.ndarray, np.ndarray]:
        s = Session(tiny, SessionParams(n_ctx=64, n_seq_max=3))
        for i in range(3):
            s.decode(Batch.of_sequence([5 + i, 6], 0, i))
        batch = Batch(np.array([1, 2, 3], np.int32), np.full(3, 2, np.int32), np.arange(3, dtype=np.int32),
                      np.ones(3, bool))
        return s.decode_sampled_logprobs(batch, BatchedSampler(settings, 64).rows(np.arange(3)), n_probs=2)

    want_ids, want_lp = run()
    marked = []
    for name in ("sample_rows", "sample_rows_serial"):
        real = getattr(cpu_sample, name)

        def marking(logits, params, u, recent, bias_ids, bias_vals, out, real=real):
            real(logits, params, u, recent, bias_ids, bias_vals, out)
            out[1] = ops.SAMPLE_ON_HOST
            marked.append(name)

        monkeypatch.setattr(cpu_sample, name, marking)
    ids, lp = run()
    assert marked
    assert ids.tolist() == want_ids.tolist()
    np.testing.assert_allclose(lp, want_lp, rtol=0, atol=1e-5)
