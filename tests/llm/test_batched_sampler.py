"""The batched sampler (ops.sample with BatchedSampler's rows) against the reference sampler
(core/llm/sampling.py) row by row: same settings and seeds give the same tokens, step after step, from the
numpy reference kernel, the compiled CPU kernel and a real decode graph (Session.decode_sampled)."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cpu import sample as cpu_sample
from ggrun.core.backends.kernels import _sample_row
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.batched_sampler import BatchedSampler, param_row
from ggrun.core.llm.model import Model
from ggrun.core.llm.numerics import NonFiniteLogits
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.synthetic import write_variant
from tests.llm.test_numerics import LLAMA, poisoned

SETTINGS = [
    SamplingParams(seed=1),
    SamplingParams(temp=0.0, seed=2),
    SamplingParams(temp=1.3, top_k=0, top_p=0.9, min_p=0.0, seed=3),
    SamplingParams(temp=0.7, top_k=5, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, seed=4),
    SamplingParams(temp=1.0, top_k=40, top_p=1.0, min_p=0.2, seed=5, logit_bias=((3, -np.inf), (7, 2.0))),
    SamplingParams(temp=0.9, top_k=300, top_p=0.5, min_p=0.0, seed=6, repeat_last_n=8, repeat_penalty=1.1),
    SamplingParams(temp=0.0, repeat_penalty=1.5, repeat_last_n=-1, seed=7),
    SamplingParams(temp=2.0, top_k=1, seed=8),
]


def kernel_tokens(logits: np.ndarray, rows, compiled: bool) -> np.ndarray:
    u = rows.draws.view(np.float64)[:, 0]
    if compiled:
        out = np.zeros(len(logits), dtype=np.int32)
        cpu_sample.sample_rows(logits, rows.params, u, rows.recent, rows.bias_ids, rows.bias_vals, out)
        return out
    return np.array([_sample_row(np, logits[i], rows.params[i], float(u[i]), rows.recent[i], rows.bias_ids[i],
                                 rows.bias_vals[i]) for i in range(len(logits))])


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("compiled", [False, True], ids=["reference-kernel", "cpu-kernel"])
def test_rows_draw_the_reference_samplers_tokens(compiled, ties):
    """Random logits over 150 steps: every row's token equals its own reference sampler's, which accepts the
    same tokens (so the penalties see the same history); with ties, logits of whole numbers, so that many equal
    the k-th largest: every sampler takes and orders equal logits by id (kernels.top_k_ids)."""
    rng = np.random.default_rng(0)
    refs = [Sampler(p, n_ctx=64) for p in SETTINGS]
    batched = BatchedSampler(SETTINGS, n_ctx=64)
    slots = np.arange(len(SETTINGS))
    for i, r in enumerate(refs):  # a prompt each: the penalties start with something to count
        prompt = rng.integers(0, 50, 20).tolist()
        for t in prompt:
            r.accept(t)
        batched.accept(i, prompt)
    for step in range(150):
        logits = (rng.standard_normal((len(SETTINGS), 1000)) * 3).astype(np.float32)
        if ties:
            logits = np.round(logits)
        rows = batched.rows(slots)
        want = np.array([r.sample(row) for r, row in zip(refs, logits)])
        got = kernel_tokens(logits, rows, compiled)
        np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        for r, t in zip(refs, want):
            r.accept(int(t))
        batched.accept_rows(slots, want.astype(np.int32))


def test_rows_of_a_slot_subset_use_each_slots_own_stream():
    """Drawing for some slots only leaves the others' streams where they were."""
    params = [SamplingParams(temp=1.0, seed=s) for s in range(4)]
    a, b = BatchedSampler(params), BatchedSampler(params)
    a.rows(np.array([1, 3]))
    u_a = a.rows(np.arange(4)).draws.view(np.float64)[:, 0]
    u_b = b.rows(np.arange(4)).draws.view(np.float64)[:, 0]
    assert u_a[0] == u_b[0] and u_a[2] == u_b[2]
    assert u_a[1] != u_b[1] and u_a[3] != u_b[3]


def test_non_finite_logits_give_minus_one_in_both_kernels():
    logits = np.zeros((3, 10), dtype=np.float32)
    logits[1, 4] = np.nan
    logits[2, 0] = np.inf
    rows = BatchedSampler([SamplingParams(seed=1)] * 3).rows(np.arange(3))
    for compiled in (False, True):
        assert kernel_tokens(logits, rows, compiled)[1:].tolist() == [-1, -1]


def test_top_p_rounds_up_to_an_f32():
    """The f32 kept for top-p compares with an f32 cumulative probability as the double does."""
    for top_p in (0.95, 0.9, 0.5, 1 / 3):
        t = param_row(SamplingParams(top_p=top_p))[2]
        assert float(t) >= top_p and float(np.nextafter(t, np.float32(0))) < top_p


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


def test_decode_sampled_draws_what_the_reference_draws_from_the_logits(tiny):
    """A decode step of three sequences through the graph's ops.sample: the ids are the reference samplers'
    tokens from the very logits the step computed (kept with with_logits)."""
    settings = [SamplingParams(seed=s, temp=0.9, repeat_penalty=1.2) for s in range(3)]
    s = Session(tiny, SessionParams(n_ctx=256, n_seq_max=3))
    refs = [Sampler(p, 256) for p in settings]
    batched = BatchedSampler(settings, 256)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    for i, p in enumerate(prompts):
        s.decode(Batch.of_sequence(p, 0, i))
        batched.accept(i, p)
        for t in p:
            refs[i].accept(t)
    nxt = [7, 10, 14]
    pos = [len(p) for p in prompts]
    for _ in range(5):
        batch = Batch(np.array(nxt, np.int32), np.array(pos, np.int32), np.arange(3, dtype=np.int32), np.ones(3, bool))
        ids, logits = s.decode_sampled(batch, batched.rows(np.arange(3)), with_logits=True)
        want = [r.sample(row) for r, row in zip(refs, logits)]
        assert ids.tolist() == want
        for r, t in zip(refs, want):
            r.accept(t)
        batched.accept_rows(np.arange(3), ids)
        nxt, pos = ids.tolist(), [p + 1 for p in pos]
    assert s.result.params.sampler == (64, 1)


def test_decode_sampled_reports_non_finite_logits(tmp_path):
    """A NaN in the logits makes the sample op answer -1, and decode_sampled raises as decode does."""
    path = write_variant(tmp_path / "nan.gguf", LLAMA, edit=poisoned("blk.1.ffn_down.weight", 5, np.nan))
    s = Session(Model.load(path, [CPUBackend()]), SessionParams(n_ctx=64, n_seq_max=2))
    batch = Batch(np.array([1, 2], np.int32), np.array([0, 0], np.int32), np.array([0, 1], np.int32), np.ones(2, bool))
    with pytest.raises(NonFiniteLogits, match="NaN"):
        s.decode_sampled(batch, BatchedSampler([SamplingParams(seed=1)] * 2).rows(np.arange(2)))
