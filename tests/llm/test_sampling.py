"""The sampler against llama.cpp's samplers (src/llama-sampler.cpp), written out here independently:
penalties (repetition, frequency, presence) over the last tokens, logit bias (--ignore-eos as -inf on
end-of-generation tokens), and the chain's order: the penalties and the bias act before top-k, top-p
and min-p choose the candidates."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from ggrun.core.errors import BadInput, RuntimeFailure
from ggrun.core.llm.sampling import Sampler, SamplingParams


def penalized(logits: np.ndarray, recent: list[int], repeat: float, freq: float, present: float) -> np.ndarray:
    """llama_sampler_penalties_apply, token by token."""
    out = logits.astype(np.float64).copy()
    for tid, count in Counter(recent).items():
        out[tid] = out[tid] * repeat if out[tid] <= 0 else out[tid] / repeat
        out[tid] -= count * freq + (count > 0) * present
    return out


def greedy(params: SamplingParams, logits: np.ndarray, recent: list[int]) -> int:
    s = Sampler(params)
    for t in recent:
        s.accept(t)
    return s.sample(logits)


@pytest.mark.parametrize("repeat, freq, present", [(1.3, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, 0.7), (1.2, 0.3, 0.5)])
def test_penalties_match_llama_cpp(repeat, freq, present):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    recent = [3, 3, 3, 7, 7, 11, 20, 3]
    s = Sampler(SamplingParams(temp=0, repeat_penalty=repeat, frequency_penalty=freq, presence_penalty=present))
    for t in recent:
        s.accept(t)
    got = logits.copy()
    s._penalize(got)
    np.testing.assert_allclose(got, penalized(logits, recent, repeat, freq, present), rtol=1e-6)


def test_frequency_penalty_counts_occurrences_and_presence_counts_once():
    logits = np.array([5.0, 4.9, 4.75, 0.0], dtype=np.float32)
    recent = [0, 0, 0, 1]  # token 0 three times, token 1 once
    # frequency 0.1: token 0 -> 4.7, token 1 -> 4.8, token 2 stays 4.75
    assert greedy(SamplingParams(temp=0, frequency_penalty=0.1), logits, recent) == 1
    # presence 0.15: token 0 -> 4.85, token 1 -> 4.75, token 2 stays 4.75
    assert greedy(SamplingParams(temp=0, presence_penalty=0.15), logits, recent) == 0


def test_penalty_window_is_repeat_last_n_and_reset_forgets_it():
    logits = np.array([3.0, 2.9, 0.0], dtype=np.float32)
    s = Sampler(SamplingParams(temp=0, presence_penalty=1.0, repeat_last_n=2))
    for t in (0, 2, 2):  # token 0 has left the window of 2
        s.accept(t)
    assert s.sample(logits) == 0
    s.accept(0)
    assert s.sample(logits) == 1
    s.reset()
    assert s.sample(logits) == 0


def test_penalties_come_before_top_k():
    """Penalized first, then top-k 1 keeps the best of what remains (llama.cpp's chain order)."""
    logits = np.array([10.0, 9.0, 1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temp=1.0, top_k=1, repeat_penalty=2.0, seed=1))
    s.accept(0)
    assert {s.sample(logits) for _ in range(20)} == {1}


def test_logit_bias_minus_inf_bans_a_token_and_plus_raises_one():
    logits = np.array([2.0, 1.0, 0.5], dtype=np.float32)
    assert greedy(SamplingParams(temp=0, logit_bias=((0, -math.inf),)), logits, []) == 1
    assert greedy(SamplingParams(temp=0, logit_bias=((2, 1.6),)), logits, []) == 2
    s = Sampler(SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=3, logit_bias=((0, -math.inf),)))
    assert 0 not in {s.sample(logits) for _ in range(200)}


def test_the_seed_is_chosen_and_repeats_the_draws():
    s = Sampler(SamplingParams(seed=-1))
    assert 0 <= s.seed < 2**32
    logits = np.linspace(0, 1, 30).astype(np.float32)
    p = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s.seed)
    a, b = Sampler(p), Sampler(p)
    assert [a.sample(logits) for _ in range(20)] == [b.sample(logits) for _ in range(20)]


def test_sample_leaves_the_callers_logits_alone():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    s = Sampler(SamplingParams(temp=0, repeat_penalty=2.0, logit_bias=((2, -1.0),)))
    s.accept(1)
    s.sample(logits)
    assert logits.tolist() == [1.0, 2.0, 3.0]


def test_faults_and_bad_values():
    with pytest.raises(RuntimeFailure, match="NaN"):
        Sampler(SamplingParams()).sample(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(BadInput, match="--min-p"):
        Sampler(SamplingParams(min_p=2.0))
