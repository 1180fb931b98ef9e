"""Numeric faults (core.llm.numerics): non-finite logits stop decoding with one line naming where they
appeared and, with check_numerics, the node that produced the first non-finite value; sampling never
hides them."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ggrun.core.backends.base import all_finite
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.errors import RuntimeFailure
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.generate import generate
from ggrun.core.llm.model import Model
from ggrun.core.llm.numerics import HINT, NonFiniteLogits, non_finite_kind
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.synthetic import LlamaConfig, tokenizer_metadata, write_variant

N_VOCAB = len(tokenizer_metadata()["tokenizer.ggml.tokens"])
LLAMA = LlamaConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=N_VOCAB, n_ctx_train=256)


def poisoned(name: str, index: int, value: float):
    def edit(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name].reshape(-1)[index] = value
    return edit


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> Model:
    path = write_variant(tmp_path_factory.mktemp("nan") / "nan.gguf", LLAMA,
                         edit=poisoned("blk.1.ffn_down.weight", 5, np.nan))
    return Model.load(path, [CPUBackend()])


@pytest.fixture(scope="module")
def good_model(tmp_path_factory) -> Model:
    return Model.load(write_variant(tmp_path_factory.mktemp("good") / "good.gguf", LLAMA), [CPUBackend()])


def session(model: Model, check: bool = False) -> Session:
    return Session(model, SessionParams(n_ctx=64, n_ubatch=16, check_numerics=check))


def test_non_finite_kind():
    assert non_finite_kind(np.ones(4, np.float32)) is None
    assert non_finite_kind(np.array([1, np.nan], np.float32)) == "NaN"
    assert non_finite_kind(np.array([1, -np.inf], np.float16)) == "inf"
    assert non_finite_kind(np.array([np.inf, np.nan])) == "NaN and inf"
    assert non_finite_kind(np.arange(3)) is None


def test_all_finite_answers_as_isfinite():
    """The one-pass sum settles only all-finite logits; a fault anywhere, or finite values whose sum
    overflows, is read element by element, so the answer is np.isfinite(x).all()'s."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 1000)).astype(np.float32)
    cases = [logits, logits[:1], logits[:, ::3], np.zeros((0, 5), np.float32),
             np.full(4, 3e38, np.float32),  # finite, its sum is not
             np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max] * 3, np.float32),
             logits.astype(np.float16), logits.astype(np.float64), np.arange(6)]
    for value in (np.nan, np.inf, -np.inf):
        for where in (0, 777, 1999):
            bad = logits.copy()
            bad.reshape(-1)[where] = value
            cases.append(bad)
    both = logits.copy()
    both[0, 3], both[1, 9] = np.inf, -np.inf  # their sum is NaN: still not finite
    cases.append(both)
    for x in cases:
        assert all_finite(x) is bool(np.isfinite(x).all()), x


def test_decode_stops_at_non_finite_logits(nan_model):
    with pytest.raises(NonFiniteLogits) as info:
        session(nan_model).decode(Batch.of_sequence([1, 2, 3], 0))
    assert str(info.value) == f"{nan_model.path}: non-finite logits (NaN) at positions 0..2; {HINT}"


@pytest.mark.parametrize("debug_env", [False, True])
def test_check_numerics_names_the_first_node_and_its_weight(nan_model, monkeypatch, debug_env):
    if debug_env:
        monkeypatch.setenv("GGRUN_GRAPH_DEBUG", "1")
    with pytest.raises(NonFiniteLogits) as info:
        session(nan_model, check=not debug_env).decode(Batch.of_sequence([7], 4))
    # the node is the product by the weight (a norm weight's NaN is refused at load: test_tensor_values.py)
    assert re.fullmatch(re.escape(f"{nan_model.path}: ") +
                        r"non-finite logits \(NaN\) at position 4; the first non-finite value \(NaN\) comes from "
                        r"node \S+-1 f32\[[\d, ]+\] \(\w+\), whose weight blk\.1\.ffn_down\.weight holds NaN",
                        str(info.value)), str(info.value)


def test_an_overflow_is_named_without_a_bad_weight(tmp_path):
    """Huge but finite weights: the first product that overflows is the culprit, no weight is blamed."""
    path = write_variant(tmp_path / "big.gguf", LLAMA, edit=poisoned("blk.0.attn_norm.weight", 0, 3e38))
    s = session(Model.load(path, [CPUBackend()]), check=True)
    with pytest.raises(NonFiniteLogits, match=r"the first non-finite value \(inf\) comes from node \S+ f(16|32)\[[\d, ]+\] \(\w+\)$"):
        s.decode(Batch.of_sequence([7], 0))


def test_generate_names_the_prompt(nan_model):
    prefix = re.escape(f"{nan_model.path}: ")
    with pytest.raises(NonFiniteLogits, match=rf"^{prefix}non-finite logits \(NaN\) while evaluating the prompt \(3 tokens\); "):
        generate(session(nan_model), [1, 2, 3], 4, Sampler(SamplingParams(temp=0)), lambda t: None)


def test_generate_names_the_step(good_model, monkeypatch):
    """Logits that turn non-finite after two generated tokens stop generation at step 2."""
    s = session(good_model, check=True)
    real = s.sched.cpu.get_tensor  # the CPU backend's get_checked reads the logits through it
    calls = []

    def get_tensor(t):
        out = real(t)
        calls.append(1)
        return out * np.nan if len(calls) == 3 else out

    monkeypatch.setattr(s.sched.cpu, "get_tensor", get_tensor)
    tokens: list[int] = []
    with pytest.raises(NonFiniteLogits) as info:
        generate(s, [1, 2, 3], 8, Sampler(SamplingParams(temp=0)), tokens.append, ignore_eos=True)
    assert len(tokens) == 2
    assert str(info.value) == (f"{good_model.path}: non-finite logits (NaN) at generation step 2 (position 4); "
                               "no graph node holds one when recomputed")


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_sampling_never_hides_non_finite_logits(temp):
    sampler = Sampler(SamplingParams(temp=temp, seed=1))
    logits = np.zeros(10, np.float32)
    assert sampler.sample(logits) in range(10)
    logits[3] = np.nan
    with pytest.raises(RuntimeFailure, match="^cannot sample from logits that hold NaN$"):
        sampler.sample(logits)
