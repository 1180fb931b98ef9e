"""core.llm.perplexity and core.llm.kl_divergence: llama-perplexity's chunking (BOS in place of each
chunk's first token, second halves scored, -b smaller than -c), its estimate and uncertainty, and its
KL-divergence file and statistics, checked against independent float64 arithmetic and a tiny llama's
reference forward pass (tests/llm/llama_reference.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.llm import kl_divergence as kl
from ggrun.core.llm.model import Model
from ggrun.core.llm.perplexity import Estimate, evaluate_chunks, plan_chunks, token_nll
from ggrun.core.llm.session import Session, SessionParams
from tests.llm.llama_reference import ReferenceLlama


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# ---- chunking ------------------------------------------------------------------------------------


def test_plan_cuts_whole_chunks_and_scores_second_halves():
    plan = plan_chunks(1000, 256)
    assert (plan.n_ctx, plan.n_chunks, plan.first, plan.n_scored) == (256, 3, 128, 127)  # 1000 // 256, tail dropped
    assert plan_chunks(1000, 256, max_chunks=2).n_chunks == 2
    assert plan_chunks(1000, 256, max_chunks=9).n_chunks == 3
    assert plan_chunks(20, 7).n_scored == 7 - 3 - 1


@pytest.mark.parametrize("n_tokens, n_ctx, chunks, message", [
    (511, 256, -1, "only 511 tokens; perplexity with a context of 256 needs at least 512"),
    (100, 2, -1, "-c 2: a perplexity chunk needs at least 4 tokens"),
    (100, 8, 0, "--chunks 0"),
    (100, 8, -3, "--chunks -3"),
])
def test_plan_refuses_what_llama_perplexity_refuses(n_tokens, n_ctx, chunks, message):
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_chunks(n_tokens, n_ctx, chunks)


# ---- arithmetic ----------------------------------------------------------------------------------


def test_token_nll_is_the_negative_log_softmax_of_the_target():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((9, 300)) * 4).astype(np.float32)
    targets = rng.integers(0, 300, 9)
    want = -log_softmax64(logits)[np.arange(9), targets]
    np.testing.assert_allclose(token_nll(logits, targets), want, rtol=1e-6)


def test_estimate_is_llama_perplexity_arithmetic():
    """PPL = exp(mean nll); uncertainty = PPL * sqrt((mean(nll^2) - mean^2) / (count - 1)); the running
    estimate after each add is what llama-perplexity prints as [1]x,[2]y,..."""
    est = Estimate()
    a, b = np.array([1.0, 2.0, 4.0]), np.array([0.5, 3.0])
    est.add(a)
    est.add(b)
    allv = np.concatenate([a, b])
    mean = allv.mean()
    assert est.count == 5
    assert est.perplexity == pytest.approx(math.exp(mean), rel=1e-12)
    assert est.uncertainty == pytest.approx(math.exp(mean) * math.sqrt(((allv ** 2).mean() - mean ** 2) / 4), rel=1e-12)
    assert est.running == pytest.approx([math.exp(a.mean()), math.exp(mean)])
    same = Estimate()
    same.add(np.array([2.0, 2.0]))
    assert math.isnan(same.uncertainty)  # llama.cpp: "Unexpected negative standard deviation"


# ---- chunks on a model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    return Model.load(tiny_llama_path, [CPUBackend()]), ReferenceLlama.load(tiny_llama_path)


TOKENS = [int(x) for x in np.random.default_rng(7).integers(0, 256, 37)]


@pytest.mark.parametrize("n_batch", [16, 5], ids=["one-batch", "batches-of-5"])
def test_chunks_are_scored_like_llama_perplexity(tiny, n_batch):
    """37 tokens at -c 16: two chunks (the last 5 tokens are left out); each is evaluated from an empty
    cache with BOS in place of its first token, and positions 8..14 are scored against tokens 9..15.
    Decoding a chunk in batches of 5 (positions continuing) gives the same rows."""
    model, ref = tiny
    bos = 3
    plan = plan_chunks(len(TOKENS), 16)
    session = Session(model, SessionParams(n_ctx=16, n_batch=n_batch, n_ubatch=n_batch, type_k=DType.F32, type_v=DType.F32))
    chunks = list(evaluate_chunks(session, TOKENS, plan, n_batch, bos))
    assert [c.index for c in chunks] == [0, 1]
    for c in chunks:
        window = TOKENS[16 * c.index:16 * (c.index + 1)]
        assert list(c.tokens) == window
        fed = [bos] + window[1:]
        want = ref.logits(fed)[8:15]
        assert c.logits.shape == (7, model.hp.n_vocab)
        np.testing.assert_allclose(c.logits, want, atol=1e-4)
        assert list(c.targets) == window[9:16]


# ---- the KL-divergence file and statistics ---------------------------------------------------------


def test_saved_log_probs_round_trip_within_half_a_step():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((5, 301)) * 3).astype(np.float32)  # odd vocabulary: one padding value
    rows = kl.quantize_log_probs(logits)
    assert rows.shape == (5, kl.row_width(301)) == (5, 2 * 151 + 4)
    back = kl.dequantize_log_probs(rows, 301)
    lp = log_softmax64(logits)
    top = lp.max(axis=1, keepdims=True)
    kept = lp > top - 16
    scale = np.ascontiguousarray(rows[:, :4]).view(np.float32)[:, 0]
    assert np.all(np.abs(back - lp)[kept] <= (scale[:, None] * 0.5 + 1e-5).repeat(301, 1)[kept])
    assert np.all(rows[:, 4 + 301:] == 0)


def test_file_holds_llama_cpp_header_and_rows(tmp_path):
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 50, 3 * 8).astype(np.int32)
    path = tmp_path / "base.kld"
    w = kl.LogProbWriter(path, 8, 50, 2, tokens)
    chunks = [(rng.standard_normal((3, 50)) * 2).astype(np.float32) for _ in range(2)]
    for c in chunks:
        w.write(c)
    w.close()
    data = path.read_bytes()
    assert data[:8] == b"_logits_"
    assert np.frombuffer(data, np.uint32, 1, 8)[0] == 8
    assert list(np.frombuffer(data, np.int32, 2, 12)) == [50, 2]
    assert list(np.frombuffer(data, np.int32, 16, 20)) == list(tokens[:16])  # n_chunk * n_ctx tokens
    assert len(data) == 20 + 16 * 4 + 2 * 3 * kl.row_width(50) * 2
    r = kl.LogProbReader(path)
    assert (r.n_ctx, r.n_vocab, r.n_chunks, r.n_rows) == (8, 50, 2, 3)
    for i, c in enumerate(chunks):
        np.testing.assert_array_equal(r.chunk(i), kl.quantize_log_probs(c))
    with pytest.raises(BadInput, match="ends inside"):
        r.chunk(2)
    r.close()


def test_reader_refuses_other_files(tmp_path):
    bad = tmp_path / "bad.kld"
    bad.write_bytes(b"GGUF and more bytes here......")
    with pytest.raises(BadInput, match="does not look like a file of log-probabilities"):
        kl.LogProbReader(bad)
    with pytest.raises(BadInput, match="cannot read"):
        kl.LogProbReader(tmp_path / "missing.kld")


def test_kl_statistics_against_float64():
    """Mean KL divergence, Δp and same-top agreement of two random distributions, against a direct float64
    computation from the saved (16-bit) base log-probabilities."""
    rng = np.random.default_rng(5)
    n, v = 40, 200
    base_logits = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    logits = base_logits + (rng.standard_normal((n, v)) * 0.7).astype(np.float32)
    targets = rng.integers(0, v, n)
    rows = kl.quantize_log_probs(base_logits)
    stats = kl.KLStats()
    stats.add(logits[:25], targets[:25], rows[:25])
    stats.add(logits[25:], targets[25:], rows[25:])
    base_lp = kl.dequantize_log_probs(rows, v).astype(np.float64)
    lp = log_softmax64(logits)
    p_base = np.where(base_lp > -16, np.exp(base_lp), 0.0)
    kld = (p_base * (base_lp - lp)).sum(axis=1)
    p_diff = np.exp(lp[np.arange(n), targets]) - np.exp(base_lp[np.arange(n), targets])
    assert stats.count == n
    assert stats.kld()[0] == pytest.approx(kld.mean(), rel=1e-4)
    assert stats.kld()[1] == pytest.approx(math.sqrt(kld.var() / (n - 1)), rel=1e-3)
    assert stats.p_diff()[0] == pytest.approx(p_diff.mean(), abs=1e-6)
    assert stats.p_diff_rms()[0] == pytest.approx(math.sqrt((p_diff ** 2).mean()), rel=1e-4)
    same = (logits.argmax(1) == base_lp.argmax(1)).mean()
    assert stats.same_top()[0] == pytest.approx(same)
    assert stats.ppl()[0] == pytest.approx(math.exp(-lp[np.arange(n), targets].mean()), rel=1e-5)
    kv, pv = stats.sorted_values()
    assert list(kv) == pytest.approx(sorted(kld), rel=1e-3, abs=1e-6)
    assert kl.percentile(kv, 0.5) == pytest.approx(float(np.percentile(kv, 50)), rel=1e-5)
    assert kl.median(kv) == pytest.approx(float(np.median(kv)), rel=1e-6)


def test_a_model_against_its_own_saved_run():
    """Logits compared with their own saved log-probabilities: KL divergence near 0 (only the 16-bit
    rounding), the same top token everywhere, the two perplexities nearly equal."""
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((30, 500)) * 1.5).astype(np.float32)  # every token within 16 nats of the top
    targets = rng.integers(0, 500, 30)
    stats = kl.KLStats()
    stats.add(logits, targets, kl.quantize_log_probs(logits))
    assert abs(stats.kld()[0]) < 1e-6
    assert stats.same_top() == (1.0, 0.0)
    assert stats.ppl()[0] == pytest.approx(stats.ppl_base()[0], rel=1e-4)


def test_mean_and_uncertainty_is_llama_cpp_arithmetic():
    assert kl.mean_and_uncertainty(0.0, 0.0, 0) == (0.0, 0.0)
    assert kl.mean_and_uncertainty(10.0, 30.0, 5) == (2.0, 0.0)  # 10 values or fewer: no uncertainty
    values = np.arange(1.0, 13.0)
    mean, unc = kl.mean_and_uncertainty(values.sum(), (values ** 2).sum(), 12)
    assert mean == pytest.approx(6.5)
    assert unc == pytest.approx(math.sqrt(values.var() / 11))
