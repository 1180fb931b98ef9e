"""Comparisons of a real model with llama.cpp's reference outputs (tests/data/reference_*.json),
shared by the real-model tests: scoring a text in one batch, and greedy continuations."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggrun.core.llm.generate import generate
from ggrun.core.llm.perplexity import Score, score_window
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams


@dataclass
class ScoreComparison:
    score: Score
    agreement: float  # share of positions where the top-1 equals llama.cpp's
    nll_gap: float  # mean |our nll - llama.cpp's| of the actual next token
    reference_perplexity: float


def compare_score(model, ref: dict, record_property, label: str, flash_attn: bool = True) -> ScoreComparison:
    """Score ref's text in one batch and one micro-batch (as llama.cpp scored it, n_kv = 256)."""
    tokens = model.tokenizer.tokenize(ref["text"], add_special=True, parse_special=False)
    assert tokens == ref["tokens"]
    session = Session(model, SessionParams(n_ctx=256, n_batch=256, n_ubatch=512, flash_attn=flash_attn))
    assert session.kv.n_ctx >= len(tokens)
    score = score_window(session, tokens)
    positions = ref["positions"]
    assert score.n_tokens == len(positions) == len(tokens) - 1
    assert [p["next"] for p in positions] == tokens[1:]
    agreement = float(np.mean(score.argmax == np.array([p["argmax"] for p in positions])))
    nll_gap = float(np.abs(score.nll + np.array([p["logprob_next"] for p in positions])).mean())
    record_property("argmax_agreement", agreement)
    record_property("perplexity", score.perplexity)
    record_property("mean_abs_nll_gap", nll_gap)
    print(f"\n{label} score ({'fused' if flash_attn else 'unfused'} attention): argmax agreement {agreement:.1%}, perplexity {score.perplexity:.4f} "
          f"(llama.cpp {ref['perplexity']:.4f}), mean |nll - llama.cpp's| {nll_gap:.4f}")
    return ScoreComparison(score, agreement, nll_gap, ref["perplexity"])


def greedy(model, prompt: list[int], n: int, n_ubatch: int = 512) -> list[int]:
    s = Session(model, SessionParams(n_ctx=64, n_batch=64, n_ubatch=n_ubatch))
    out, _ = generate(s, prompt, n, Sampler(SamplingParams(temp=0)), lambda t: None, ignore_eos=True)
    return out


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_greedy(model, ref: dict, extra_steps: int, record_property) -> None:
    """Greedy tokens equal llama.cpp's up to safe_n (its first top-2 margin below 0.2); how far they
    agree beyond, up to extra_steps more, is recorded and printed, not required."""
    prompt = model.tokenizer.tokenize(ref["prompt"], add_special=True, parse_special=True)
    assert prompt == ref["prompt_tokens"]
    safe_n = ref["safe_n"]
    assert safe_n == next((i for i, m in enumerate(ref["margins"]) if m < 0.2), len(ref["margins"]))
    n = min(len(ref["tokens"]), safe_n + extra_steps)
    out = greedy(model, prompt, n)
    agree = agreeing_prefix(out, ref["tokens"])
    record_property("safe_n", safe_n)
    record_property("agreeing_tokens", agree)
    print(f"\n{ref['prompt']!r}: agrees with llama.cpp for {agree} of {n} tokens (safe_n {safe_n}): "
          f"{model.tokenizer.detokenize(out)!r}")
    assert out[:safe_n] == ref["tokens"][:safe_n]
    assert model.tokenizer.detokenize(out[:safe_n]) == ref["safe_text"]
