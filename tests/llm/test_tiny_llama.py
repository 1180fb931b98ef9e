"""The model runtime on synthetic tiny llama files, against an independent float64 numpy forward
pass (tests/llm/llama_reference.py): load, session, decode, generate and perplexity, with separate
and tied output heads, f32/f16/q8_0 weights, f32 and f16 KV caches, and any micro-batch size."""
from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.dtypes import DType
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.generate import generate
from ggrun.core.llm.model import Model
from ggrun.core.llm.perplexity import score_window
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.synthetic import EOT, tiny_bpe_vocab
from tests.llm.llama_reference import ReferenceLlama, perplexity

# 20 token ids spread over the tiny vocabulary (bytes, merges, the control token).
PROMPT = [104, 101, 108, 108, 111, 256, 263, 32, 119, 275, 10, 66, 200, 7, 268, 258, 111, 33, 120, 99]


def load(path) -> Model:
    return Model.load(path, [CPUBackend()])


def all_logits(session: Session, tokens: list[int]) -> np.ndarray:
    """Logits of every token of one sequence at positions 0.., decoded as one batch."""
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, i, 0, True)
    return session.decode(b)


def session(model: Model, n_ctx: int = 64, n_ubatch: int = 512, kv_type: DType = DType.F32) -> Session:
    return Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch, type_k=kv_type, type_v=kv_type))


@pytest.mark.parametrize("tied", [False, True], ids=["separate-head", "tied-head"])
@pytest.mark.parametrize("weight_type", [QT.F32, QT.F16], ids=lambda t: t.name)
def test_logits_match_reference(tiny_llama_factory, weight_type, tied):
    path = tiny_llama_factory(weight_type=weight_type, tied_output=tied)
    model = load(path)
    assert ("output.weight" in model.gguf.tensors) is not tied
    got = all_logits(session(model), PROMPT)
    want = ReferenceLlama.load(path).logits(PROMPT)
    assert got.shape == want.shape == (len(PROMPT), model.hp.n_vocab)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_tied_head_uses_the_embedding(tiny_llama_factory):
    """A tied model's logits are hidden states times token_embd: with a different embedding they change."""
    tied = load(tiny_llama_factory(weight_type=QT.F32, tied_output=True))
    assert tied.weights["output.weight"] is tied.weights["token_embd.weight"]
    separate = load(tiny_llama_factory(weight_type=QT.F32, tied_output=False))
    assert separate.weights["output.weight"] is not separate.weights["token_embd.weight"]


def test_f16_kv_cache_stays_close_to_reference(tiny_llama_path):
    """The default f16 cache (as llama.cpp's) rounds K, V and what meets them: small, bounded drift."""
    model = load(tiny_llama_path)
    got = all_logits(session(model, kv_type=DType.F16), PROMPT)
    want = ReferenceLlama.load(tiny_llama_path).logits(PROMPT)
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=0)


def test_q8_0_weights_decode_exactly(tiny_llama_factory):
    """q8_0 weights, with the 8-bit activation rounding switched off, give the f64 reference's logits:
    the weights are decoded and multiplied exactly as the file says."""
    path = tiny_llama_factory(weight_type=QT.Q8_0)
    model = load(path)
    flagged = [t for t in model.weights.tensors.values() if t.params.get("act_quant")]
    assert {t.name for t in flagged} >= {"token_embd.weight", "output.weight", "blk.0.attn_q.weight"}
    for t in flagged:
        del t.params["act_quant"]
    ref = ReferenceLlama.load(path)
    ref.q8_acts = set()
    np.testing.assert_allclose(all_logits(session(model), PROMPT), ref.logits(PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [False, True], ids=["separate-head", "tied-head"])
def test_q8_0_weights_with_activation_rounding(tiny_llama_factory, tied):
    """With llama.cpp's 8-bit activation blocks the logits stay near a reference that rounds activations
    like llama.cpp's quantize_row_q8_0. The bound is loose on purpose: ggrun derives the rounding
    multiplier from the f16-rounded scale while llama.cpp uses 127/amax, which flips a few q steps, and a
    random 64-wide model amplifies that (measured max ~0.08-0.15 on logits of scale ~4)."""
    path = tiny_llama_factory(weight_type=QT.Q8_0, tied_output=tied)
    got = all_logits(session(load(path)), PROMPT)
    want = ReferenceLlama.load(path).logits(PROMPT)
    assert np.abs(got - want).mean() < 0.05
    assert np.abs(got - want).max() < 0.4
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.7


@pytest.mark.parametrize("kv_type", [DType.F16, DType.F32], ids=["kv-f16", "kv-f32"])
def test_micro_batch_size_does_not_change_logits(tiny_llama_path, kv_type):
    """-ub 1, 7 and 512 split a 20-token batch into 20, 3 and 1 graphs; the logits agree within 1e-3."""
    model = load(tiny_llama_path)
    by_ub = {ub: all_logits(session(model, n_ubatch=ub, kv_type=kv_type), PROMPT) for ub in (1, 7, 512)}
    for ub in (1, 7):
        np.testing.assert_allclose(by_ub[ub], by_ub[512], atol=1e-3, rtol=0, err_msg=f"-ub {ub} vs 512")
    want = ReferenceLlama.load(tiny_llama_path).logits(PROMPT)
    np.testing.assert_allclose(by_ub[7], want, atol=1e-4 if kv_type is DType.F32 else 1e-2, rtol=0)


def test_micro_batch_size_does_not_change_q8_0_logits_without_activation_rounding(tiny_llama_factory):
    """Quantized weights alone keep -ub invariance. (With llama.cpp's roundings on, 8-bit activations
    and attention's f16 sums of values, last-bit differences between product paths flip a few rounding
    steps: about 1e-3 here at -ub 1 and up to 1 logit on SmolLM2, whose greedy tokens test_smollm2
    checks instead.)"""
    model = Model.load(tiny_llama_factory(weight_type=QT.Q8_0), [CPUBackend()], numerics="f32")
    by_ub = {ub: all_logits(session(model, n_ubatch=ub, kv_type=DType.F16), PROMPT) for ub in (1, 7, 512)}
    for ub in (1, 7):
        np.testing.assert_allclose(by_ub[ub], by_ub[512], atol=1e-3, rtol=0, err_msg=f"-ub {ub} vs 512")


@pytest.mark.parametrize("n_ubatch", [1, 7, 512])
def test_micro_batches_build_one_graph_per_shape(tiny_llama_path, n_ubatch):
    """A 20-token batch in micro-batches of n: full ones share one graph, a shorter tail needs its own."""
    s = session(load(tiny_llama_path), n_ubatch=n_ubatch)
    all_logits(s, PROMPT)
    n_full, tail = divmod(len(PROMPT), n_ubatch)
    assert s.stats.graphs_built == (1 if n_full else 0) + (1 if tail else 0)
    assert s.stats.graphs_built + s.stats.graphs_reused == n_full + (1 if tail else 0)


@pytest.mark.parametrize("n_ubatch", [1, 7, 512])
def test_greedy_generation_matches_reference(tiny_llama_path, n_ubatch):
    """generate() with temperature 0 picks the reference's argmax at every step; decode steps after the
    prompt reuse one graph (their shapes do not change while n_kv stays within one padding step)."""
    model = load(tiny_llama_path)
    prompt, n = PROMPT[:9], 8
    s = session(model, n_ubatch=n_ubatch)
    streamed: list[int] = []
    out, st = generate(s, prompt, n, Sampler(SamplingParams(temp=0)), streamed.append, ignore_eos=True)
    assert out == streamed == ReferenceLlama.load(tiny_llama_path).greedy(prompt, n)
    assert (st.n_prompt, st.n_eval, st.stop_reason) == (9, n - 1, "n_predict reached")
    assert s.stats.reuse_log[-(n - 2):] == [(True, "reused")] * (n - 2)


def test_generation_stops_at_end_of_generation_token(tiny_llama_path):
    """Without ignore_eos, an EOG token ends generation and is not emitted."""
    model = load(tiny_llama_path)
    eot = model.tokenizer.eos_id
    assert model.tokenizer.is_eog(eot) and eot == tiny_bpe_vocab()[0].index(EOT)

    class EotSecond(Sampler):
        def sample(self, logits):
            self.calls = getattr(self, "calls", 0) + 1
            return eot if self.calls == 2 else 65

    out, st = generate(session(model), PROMPT[:5], 10, EotSecond(SamplingParams(temp=0)), lambda t: None)
    assert out == [65]
    assert st.stop_reason == "end of generation token"


def test_generation_stops_when_context_is_full(tiny_llama_path):
    s = session(load(tiny_llama_path), n_ctx=12)
    out, st = generate(s, PROMPT[:9], 10, Sampler(SamplingParams(temp=0)), lambda t: None, ignore_eos=True)
    assert len(out) == 12 - 9 + 1  # the token sampled from the last cell's logits still comes out
    assert st.stop_reason == "context full"


def test_perplexity_one_window_matches_reference(tiny_llama_path):
    model = load(tiny_llama_path)
    score = score_window(session(model, n_ctx=len(PROMPT)), PROMPT)
    logits = ReferenceLlama.load(tiny_llama_path).logits(PROMPT)
    ppl, nll = perplexity(logits, PROMPT)
    assert score.n_tokens == len(PROMPT) - 1
    np.testing.assert_allclose(score.nll, nll, atol=1e-4)
    assert score.perplexity == pytest.approx(ppl, rel=1e-4)
    assert list(score.argmax) == list(logits[:-1].argmax(-1))


def test_tiny_model_whole_path(tiny_llama_path):
    """Load, tokenize, generate and score through the default settings (f16 cache, -ub 512): the path
    `ggrun run` takes, in milliseconds on a tiny model."""
    model = load(tiny_llama_path)
    tokens = model.tokenizer.tokenize("hello world, the world is in the hello", add_special=True)
    assert model.tokenizer.detokenize(tokens) == "hello world, the world is in the hello"
    s = Session(model, SessionParams(n_ctx=64))
    out, st = generate(s, tokens, 6, Sampler(SamplingParams(temp=0.8, seed=42)), lambda t: None, ignore_eos=True)
    assert len(out) == 6 and all(0 <= t < model.hp.n_vocab for t in out)
    again, _ = generate(Session(model, SessionParams(n_ctx=64)), tokens, 6,
                        Sampler(SamplingParams(temp=0.8, seed=42)), lambda t: None, ignore_eos=True)
    assert again == out  # seeded sampling is reproducible
    score = score_window(Session(model, SessionParams(n_ctx=64)), tokens)
    want, _ = perplexity(ReferenceLlama.load(tiny_llama_path).logits(tokens), tokens)
    assert score.perplexity == pytest.approx(want, rel=1e-2)
