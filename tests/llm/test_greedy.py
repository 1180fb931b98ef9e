"""Greedy sampling where the logits are computed (Session.decode_greedy, ops.argmax at the graph's end): the
ids equal the argmax of decode's logits, a stand-in device sends back only those ids, switching between
decode and decode_greedy rebuilds the graph saying why, non-finite logits stop it as they stop decode, and
generation takes the path for a greedy-only sampler over logits made on a device, with the same tokens."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.generate import Generation, generate
from ggrun.core.llm.model import Model
from ggrun.core.llm.numerics import NonFiniteLogits
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.synthetic import write_variant
from tests.llm.test_numerics import LLAMA, poisoned

PROMPT = list(range(3, 30))


@pytest.fixture(scope="module")
def cpu_model(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


@pytest.fixture(scope="module")
def sim_model(tiny_llama_path) -> Model:
    """Every layer and the output head on the stand-in device: the logits are made off the host."""
    return Model.load(tiny_llama_path, [SimBackend(), CPUBackend()], 99)


def session(model: Model, check: bool = False) -> Session:
    return Session(model, SessionParams(n_ctx=96, n_ubatch=16, check_numerics=check))


def every_logit(tokens: list[int], start: int = 0) -> Batch:
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, start + i, 0, True)
    return b


@pytest.mark.parametrize("where", ["cpu", "sim"])
def test_decode_greedy_is_the_argmax_of_decode(cpu_model, sim_model, where):
    """A prompt with every position's logits, then decode steps fed each chosen token, switching mode midway."""
    model = cpu_model if where == "cpu" else sim_model
    plain, greedy = session(model), session(model)
    want = plain.decode(every_logit(PROMPT))
    got = greedy.decode_greedy(every_logit(PROMPT))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want.argmax(axis=-1))
    token, pos = int(got[-1]), len(PROMPT)
    for step in range(8):
        want = plain.decode(Batch.of_sequence([token], pos))
        batch = Batch.of_sequence([token], pos)
        got = greedy.decode(batch).argmax(axis=-1) if step in (3, 4) else greedy.decode_greedy(batch)
        np.testing.assert_array_equal(got, want.argmax(axis=-1))
        token, pos = int(got[-1]), pos + 1


def test_a_batch_without_logits_gives_no_ids(cpu_model):
    ids = session(cpu_model).decode_greedy(Batch.of_sequence(PROMPT, last_logits=False))
    assert ids.shape == (0,) and ids.dtype == np.int32


def test_only_the_ids_come_back_from_the_device(sim_model):
    sim = next(b for b in sim_model.backends if isinstance(b, SimBackend))
    s = session(sim_model)
    token = int(s.decode_greedy(Batch.of_sequence(PROMPT))[-1])
    for pos in range(len(PROMPT), len(PROMPT) + 3):
        sim.reset_counters()
        token = int(s.decode_greedy(Batch.of_sequence([token], pos))[-1])
        assert sim.bytes_out == 4
    sim.reset_counters()
    s.decode(Batch.of_sequence([token], len(PROMPT) + 3))
    assert sim.bytes_out == 4 * sim_model.hp.n_vocab


def test_switching_mode_rebuilds_saying_why(cpu_model):
    """A mode met for the first time rebuilds, saying why; switching back takes the graph kept for that
    mode. And the argmax's few bytes fit in the compute buffers reserved for graphs without it."""
    s = session(cpu_model)
    reserves = {name: a.reserves for name, a in s.sched.allocators.items()}
    token = int(s.decode(Batch.of_sequence(PROMPT))[-1].argmax())
    steps = [s.decode, s.decode, s.decode_greedy, s.decode_greedy, s.decode_greedy, s.decode, s.decode]
    for pos, step in enumerate(steps, len(PROMPT)):
        out = step(Batch.of_sequence([token], pos))
        token = int(out[-1] if out.ndim == 1 else out[-1].argmax())
    log = [what for _, what in s.stats.reuse_log[-len(steps):]]
    assert log == ["rebuilt: n_tokens 11 -> 1", "reused", "rebuilt: greedy False -> True", "reused", "reused",
                   "reused", "reused"]
    assert s.result.tokens is None and s.result.params.greedy is False
    s.decode_greedy(Batch.of_sequence(list(range(3, 19)), len(PROMPT) + len(steps)))  # n_ubatch tokens
    assert {name: a.reserves for name, a in s.sched.allocators.items()} == reserves


@pytest.fixture(scope="module")
def nan_path(tmp_path_factory):
    return write_variant(tmp_path_factory.mktemp("nan") / "nan.gguf", LLAMA,
                         edit=poisoned("blk.1.ffn_down.weight", 5, np.nan))


@pytest.fixture(scope="module")
def inf_path(tmp_path_factory):
    """One infinite value in the output head: the logits of one token are infinite, the others finite."""
    return write_variant(tmp_path_factory.mktemp("inf") / "inf.gguf", LLAMA,
                         edit=poisoned("output.weight", 5 * LLAMA.n_embd + 3, np.inf))


@pytest.mark.parametrize("fault", ["nan", "inf"])
@pytest.mark.parametrize("where", ["cpu", "sim"])
@pytest.mark.parametrize("check", [False, True])
def test_non_finite_logits_stop_decode_greedy_as_decode(nan_path, inf_path, fault, where, check):
    """The same error, kind and culprit as decode's, whether the argmax ran on the CPU or on a device."""
    backends, ngl = ([CPUBackend()], 0) if where == "cpu" else ([SimBackend(), CPUBackend()], 99)
    model = Model.load(nan_path if fault == "nan" else inf_path, backends, ngl)
    errors = []
    for decode in (session(model, check).decode, session(model, check).decode_greedy):
        with pytest.raises(NonFiniteLogits) as info:
            decode(Batch.of_sequence([7, 8], 4))
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert f"({'NaN' if fault == 'nan' else 'inf'})" in errors[1]


def test_greedy_only_samplers():
    assert Sampler(SamplingParams(temp=0)).greedy_only
    assert Sampler(SamplingParams(temp=0, top_k=1, min_p=0.5)).greedy_only
    assert not Sampler(SamplingParams(temp=0.8)).greedy_only
    assert not Sampler(SamplingParams(temp=0, repeat_penalty=1.1)).greedy_only
    assert not Sampler(SamplingParams(temp=0, presence_penalty=0.5)).greedy_only
    assert not Sampler(SamplingParams(temp=0, logit_bias=((0, -np.inf),))).greedy_only


def counted_generation(model: Model, params: SamplingParams, monkeypatch) -> tuple[Generation, list[int]]:
    """A generation over a fresh session whose decode_greedy calls are counted."""
    s = session(model)
    calls: list[int] = []
    real = s.decode_greedy

    def decode_greedy(batch):
        calls.append(len(batch))
        return real(batch)

    monkeypatch.setattr(s, "decode_greedy", decode_greedy)
    return Generation(s, Sampler(params, s.n_ctx)), calls


def generated(g: Generation, prompt: list[int], n: int) -> list[int]:
    g.extend(prompt)
    out, _ = g.generate(n, lambda t: None, ignore_eos=False)
    return out


def test_generation_chooses_on_the_device_for_a_greedy_sampler(sim_model, monkeypatch):
    """Greedy: the prompt's last batch and every step through decode_greedy; the same tokens as the host's
    argmax (a logit bias of 0 keeps the choice but makes the sampler not greedy-only); sampling: never."""
    g, calls = counted_generation(sim_model, SamplingParams(temp=0), monkeypatch)
    assert g.on_device
    tokens = generated(g, PROMPT, 12)
    assert len(tokens) == 12 and calls == [len(PROMPT)] + [1] * 11
    assert g.session.result.params.greedy
    host, host_calls = counted_generation(sim_model, SamplingParams(temp=0, logit_bias=((0, 0.0),)), monkeypatch)
    assert not host.on_device and generated(host, PROMPT, 12) == tokens and not host_calls
    sampled, sampled_calls = counted_generation(sim_model, SamplingParams(temp=0.8, seed=3), monkeypatch)
    assert not sampled.on_device
    generated(sampled, PROMPT, 6)
    assert not sampled_calls and not sampled.session.result.params.greedy


def test_generation_over_host_logits_samples_on_the_host(cpu_model, sim_model, monkeypatch):
    """Logits made on the CPU are in host memory already: generation keeps the host's argmax there."""
    g, calls = counted_generation(cpu_model, SamplingParams(temp=0), monkeypatch)
    assert not g.on_device
    assert generated(g, PROMPT, 5) and not calls


def test_a_conversation_goes_on_choosing_on_the_device(sim_model, monkeypatch):
    """Turns appended with extend: each reply starts from the id the turn's last batch chose."""
    g, calls = counted_generation(sim_model, SamplingParams(temp=0), monkeypatch)
    host, _ = counted_generation(sim_model, SamplingParams(temp=0, logit_bias=((0, 0.0),)), monkeypatch)
    for turn in (PROMPT, [40, 41, 42], [50]):
        assert generated(g, turn, 4) == generated(host, turn, 4)
    assert len(calls) == 3 * 4


def test_generate_stops_at_non_finite_logits_chosen_on_the_device(nan_path):
    s = session(Model.load(nan_path, [SimBackend(), CPUBackend()], 99))
    with pytest.raises(NonFiniteLogits, match=r"non-finite logits \(NaN\) while evaluating the prompt \(3 tokens\)"):
        generate(s, [1, 2, 3], 4, Sampler(SamplingParams(temp=0)), lambda t: None)
