"""The CUDA kernel of ops.sample (core/backends/cuda/sample.cu) against the reference sampler
(core/llm/sampling.py) row by row: the same settings and seeds draw the same tokens step after step, with
each row's penalties fed the tokens it drew; rows as wide as a vocabulary; the marks for rows the kernel
leaves to the host (-2) and for non-finite logits (-1). Each case checks that the CUDA kernel ran rather
than the cupy fallback. Skipped where cupy or a GPU is missing."""
from __future__ import annotations

import numpy as np
import pytest

from tests.core.gpu import device_indices, require_gpu

cupy = require_gpu()

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cuda import CUDABackend  # noqa: E402
from ggrun.core.backends.op_harness import planned  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402
from ggrun.core.llm.batched_sampler import BatchedSampler, SamplingRows  # noqa: E402
from ggrun.core.llm.sampling import Sampler, SamplingParams  # noqa: E402
from tests.llm.test_batched_sampler import SETTINGS  # noqa: E402


@pytest.fixture(scope="module", params=device_indices(), ids=lambda i: f"CUDA{i}")
def gpu(request):
    return CUDABackend(request.param)


class GpuSampler:
    """One planned ops.sample graph on the GPU for rows of logits [rows, vocab], run again for every step."""

    def __init__(self, gpu, rows: SamplingRows, vocab: int) -> None:
        def build(lf):
            return ops.sample(lf.input("logits", DType.F32, np.zeros((len(rows), vocab), np.float32)),
                              lf.input("params", DType.F32, rows.params), lf.input("draws", DType.I32, rows.draws),
                              lf.input("recent", DType.I32, rows.recent), lf.input("bias_ids", DType.I32, rows.bias_ids),
                              lf.input("bias_vals", DType.F32, rows.bias_vals))

        self.sched, sg, leafs, self.out = planned(gpu, build)
        self.sg, self.inputs = sg, list(leafs.feeds)
        steps = gpu.prepare(sg.splits[0].nodes).steps
        assert all(s.capturable for s in steps), "fell back to cupy array kernels"

    def __call__(self, logits: np.ndarray, rows: SamplingRows) -> np.ndarray:
        for t, data in zip(self.inputs, (logits, rows.params, rows.draws, rows.recent, rows.bias_ids, rows.bias_vals)):
            self.sched.set_tensor(t, np.ascontiguousarray(data))
        self.sched.compute(self.sg)
        return np.array(self.sched.get_tensor(self.out))


def run_steps(gpu, settings: list[SamplingParams], vocab: int, steps: int, scale: float = 3.0,
              shape=None) -> None:
    """Random logits for `steps` steps (normal, times scale, then `shape` applied when given): every row's
    token equals its own reference sampler's."""
    rng = np.random.default_rng(vocab)
    refs = [Sampler(p, n_ctx=64) for p in settings]
    batched = BatchedSampler(settings, n_ctx=64)
    slots = np.arange(len(settings))
    run = GpuSampler(gpu, BatchedSampler(settings, n_ctx=64).rows(slots), vocab)  # shapes only
    for i, r in enumerate(refs):  # a prompt each: the penalties start with something to count
        prompt = rng.integers(0, 50, 20).tolist()
        for t in prompt:
            r.accept(t)
        batched.accept(i, prompt)
    for step in range(steps):
        logits = (rng.standard_normal((len(settings), vocab)) * scale).astype(np.float32)
        if shape is not None:
            logits = shape(logits).astype(np.float32)
        rows = batched.rows(slots)
        want = np.array([r.sample(row) for r, row in zip(refs, logits)])
        np.testing.assert_array_equal(run(logits, rows), want, err_msg=f"step {step}")
        for r, t in zip(refs, want):
            r.accept(int(t))
        batched.accept_rows(slots, want.astype(np.int32))


def test_rows_draw_the_reference_samplers_tokens(gpu):
    """Every setting of the CPU kernels' test (greedy, top-k 0 over the whole row, penalties, bias, min-p)."""
    run_steps(gpu, SETTINGS, 1000, 150)


def test_vocabulary_wide_rows(gpu):
    """llama-1b's vocabulary, llama.cpp's defaults and a few variants, many rows at once."""
    settings = [SamplingParams(seed=s) for s in range(12)] + [
        SamplingParams(temp=0.0, seed=20), SamplingParams(temp=0.6, top_k=1000, top_p=0.8, min_p=0.0, seed=21),
        SamplingParams(temp=1.0, top_k=64, repeat_penalty=1.2, presence_penalty=0.5, seed=22),
        SamplingParams(temp=1.5, top_k=10, min_p=0.1, seed=23, logit_bias=((5, 4.0), (128_000, -np.inf)))]
    run_steps(gpu, settings, 128_256, 12, scale=2.0)


def test_ties_at_the_kth_value(gpu):
    """Logits of few distinct values, so that more entries equal the k-th largest than are taken: the lowest ids
    are (the select over the whole row, in order of ids)."""
    settings = [SamplingParams(seed=s) for s in range(4)] + [SamplingParams(temp=1.2, top_k=7, seed=9)]
    run_steps(gpu, settings, 128_256, 6, scale=2.0, shape=lambda x: np.round(x * 4) / 4)
    run_steps(gpu, settings, 1000, 20, scale=2.0, shape=lambda x: np.round(x))


def test_crowded_top_bin(gpu):
    """Every logit in one bin of the kernel's first histogram (the same sign, exponent and 3 leading mantissa
    bits), more of them than it gathers (sample.cu's L_CAP): the select over the whole row draws the
    reference's tokens too; and a row whose top bins hold just about L_CAP."""
    settings = [SamplingParams(seed=s) for s in range(3)] + [SamplingParams(temp=0.7, top_k=500, top_p=1.0, seed=5)]
    run_steps(gpu, settings, 20_000, 4, shape=lambda x: 1.0 + np.abs(x) / (np.abs(x).max() * 9))
    for t in (1.85, 1.9):  # ~4,100 and ~3,660 of 128k normal logits above t, moved into the bin of [10, 11)
        run_steps(gpu, settings, 128_256, 3, scale=1.0, shape=lambda x: np.where(x > t, 10 + (x - t) / 40, x))


def test_rows_beyond_the_kernels_candidates_are_left_to_the_host(gpu):
    settings = [SamplingParams(temp=1.0, top_k=0, seed=1), SamplingParams(seed=2)]
    b = BatchedSampler(settings)
    rows = b.rows(np.arange(2))
    logits = np.random.default_rng(0).standard_normal((2, 5000)).astype(np.float32)
    got = GpuSampler(gpu, rows, 5000)(logits, rows)
    assert got[0] == ops.SAMPLE_ON_HOST and 0 <= got[1] < 5000


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_give_minus_one(gpu, value):
    settings = [SamplingParams(seed=1), SamplingParams(temp=0.0, seed=2), SamplingParams(seed=3)]
    b = BatchedSampler(settings)
    rows = b.rows(np.arange(3))
    logits = np.random.default_rng(1).standard_normal((3, 3000)).astype(np.float32)
    logits[0, 17] = value
    logits[1, 2999] = value
    got = GpuSampler(gpu, rows, 3000)(logits, rows)
    assert got[0] == -1 and got[1] == -1 and 0 <= got[2] < 3000
