"""Every architecture in the registry on its tiny synthetic model (ggrun.loaders.synthetic.FAMILY_PRESETS): what each
family's contract says (hyperparameters, sliding-window layers, fused matrices loaded as parts), that
micro-batching and graph reuse leave the logits alone, and, where tests/data/families_llama_cpp.json holds
llama.cpp's results for the model (scripts/bench/arch_vs_llama.py --save-data), that ggrun ranks the same token
first at >= 98% of the positions and gives llama.cpp's top token its log-probability."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.llm.archs import ARCHS
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.perplexity import ChunkPlan, evaluate_chunks, token_nll
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.gguf_file import open_gguf
from ggrun.loaders.synthetic import FAMILY_PRESETS, drop_biases, family_options, write_tiny_family, written_once

DATA = Path(__file__).resolve().parents[1] / "data" / "families_llama_cpp.json"
PROMPT = [104, 101, 108, 108, 111, 256, 263, 32, 119, 275, 10, 66, 200, 7, 268, 258, 111, 33, 120, 99,
          40, 41, 97, 98, 260, 261, 44, 46]  # 28 tokens: longer than the gemmas' 16-token window
FAMILIES = sorted(FAMILY_PRESETS)


@pytest.fixture(scope="module")
def family_factory(tmp_path_factory):
    """write(arch=..., **options) -> path of the family's tiny model (or a variant's: FAMILY_VARIANTS), written once
    per set of options."""
    def write(path, arch, robust=None, **options):
        family, preset = family_options(arch, options.get("weight_type", QT.F32), robust)
        return write_tiny_family(path, family, **preset, **options)
    return written_once(write, tmp_path_factory.mktemp, "family")


def logits_of(model: Model, tokens: list[int], n_ubatch: int = 512, graph_reuse: bool = True) -> np.ndarray:
    """Logits of every token of one sequence (f32 KV cache)."""
    s = Session(model, SessionParams(n_ctx=64, n_batch=64, n_ubatch=n_ubatch, type_k=DType.F32, type_v=DType.F32,
                                     graph_reuse=graph_reuse))
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, i, 0, True)
    return s.decode(b)


def shrink_rope_factors(tensors: dict) -> None:
    tensors["rope_factors_long.weight"] = tensors["rope_factors_long.weight"][:-1]


def test_registry_names_every_family():
    assert set(FAMILY_PRESETS) <= set(ARCHS)
    assert all(a.name == name for name, a in ARCHS.items())


def test_an_unknown_architecture_is_one_line_naming_the_known_ones(family_factory):
    with open_gguf(family_factory(arch="llama", arch_name="mamba")) as gf, pytest.raises(BadInput) as info:
        Model.read_hparams(gf)
    message = str(info.value)
    assert "architecture 'mamba' is not supported" in message and "\n" not in message
    for name in ARCHS:
        assert name in message


@pytest.mark.parametrize("arch", FAMILIES)
def test_micro_batches_and_graph_reuse_do_not_change_logits(family_factory, arch):
    """-ub 1 and 5 decode against the cache (the gemmas' window then hides cached cells), one graph reused per
    shape; plain f32 numerics, so only float rounding separates them from one micro-batch."""
    model = Model.load(family_factory(arch=arch), [CPUBackend()], numerics="f32")
    whole = logits_of(model, PROMPT)
    assert np.isfinite(whole).all() and whole.shape == (len(PROMPT), model.hp.n_vocab)
    for ub in (1, 5):
        np.testing.assert_allclose(logits_of(model, PROMPT, n_ubatch=ub), whole, atol=2e-3, rtol=0,
                                   err_msg=f"{arch} -ub {ub}")
    np.testing.assert_allclose(logits_of(model, PROMPT, n_ubatch=5, graph_reuse=False), whole, atol=2e-3, rtol=0)


def test_qwen3_head_size_comes_from_key_length(family_factory):
    hp = Model.load(family_factory(arch="qwen3"), [CPUBackend()]).hp
    assert (hp.n_embd, hp.n_head, hp.head_dim) == (256, 8, 64) and hp.head_dim != hp.n_embd // hp.n_head


def test_gemma2_contract(family_factory):
    model = Model.load(family_factory(arch="gemma2"), [CPUBackend()])
    arch, hp = model.arch, model.hp
    assert arch.swa_layers(hp) == [True, False, True, False]
    assert hp.extra["swa_window"] == 16 and (hp.extra["attn_softcap"], hp.extra["final_softcap"]) == (1.5, 15.0)
    assert hp.extra["attn_scale"] == pytest.approx(1 / 8)
    assert np.abs(logits_of(model, PROMPT)).max() < 15.0  # the final soft-cap bounds every logit


def test_gemma2_soft_capping_changes_the_logits(family_factory):
    """Without capping (caps far above every score and logit) the logits move: the caps are applied."""
    capped = logits_of(Model.load(family_factory(arch="gemma2"), [CPUBackend()], numerics="f32"), PROMPT)
    loose = family_factory(arch="gemma2", extra_metadata=(("gemma2.attn_logit_softcapping", 1e5),
                                                          ("gemma2.final_logit_softcapping", 1e5)))
    uncapped = logits_of(Model.load(loose, [CPUBackend()], numerics="f32"), PROMPT)
    assert np.abs(capped - uncapped).max() > 1.0


def test_gpt_oss_contract(family_factory):
    model = Model.load(family_factory(arch="gpt-oss"), [CPUBackend()])
    arch, hp = model.arch, model.hp
    assert arch.swa_layers(hp) == [True, False] and hp.extra["swa_window"] == 16
    assert (hp.n_head, hp.head_dim, hp.extra["n_expert"], hp.extra["n_expert_used"], hp.extra["n_ff_exp"]) == (8, 64, 8, 2, 256)
    yarn = hp.extra["yarn"]
    assert hp.rope_freq_scale == pytest.approx(1 / 32) and (yarn.ext_factor, yarn.n_ctx_orig) == (1.0, 4096)
    assert (yarn.beta_fast, yarn.beta_slow) == (32.0, 1.0) and yarn.attn_factor == pytest.approx(1.0, abs=1e-6)


def sinks_far_below(tensors: dict) -> None:
    for name in [n for n in tensors if n.endswith("attn_sinks.weight")]:
        tensors[name] = np.full_like(tensors[name], -60.0)


def zero_expert_biases(tensors: dict) -> None:
    for name in [n for n in tensors if "_exps.bias" in n]:
        tensors[name] = np.zeros_like(tensors[name])


@pytest.mark.parametrize("change", [
    {"edit": sinks_far_below},  # a sink far below every score takes no share: the softmax without it
    {"edit": zero_expert_biases},
    {"extra_metadata": (("gpt-oss.rope.scaling.type", "none"), ("gpt-oss.rope.scaling.factor", 0.0))},  # no YaRN
], ids=["sinks", "expert_biases", "yarn"])
def test_gpt_oss_features_change_the_logits(family_factory, change):
    """Each of gpt-oss's own pieces is applied: without it (or with it made void) the logits move."""
    full = logits_of(Model.load(family_factory(arch="gpt-oss"), [CPUBackend()], numerics="f32"), PROMPT)
    without = logits_of(Model.load(family_factory(arch="gpt-oss", **change), [CPUBackend()], numerics="f32"), PROMPT)
    assert np.abs(full - without).max() > 0.5


def test_gpt_oss_offloaded_to_a_device_without_its_pieces(family_factory):
    """A device that lacks YaRN's RoPE and sinks (as CUDA did: the stand-in refuses every rope, softmax and
    fused attention) holds the layers and their caches; those nodes run on the CPU, the keys are rotated there
    and written into the device's cache: the logits are the CPU's."""
    path = family_factory(arch="gpt-oss")
    cpu = logits_of(Model.load(path, [CPUBackend()], numerics="f32"), PROMPT)
    device = SimBackend(refuse=frozenset({"rope", "rope_set_rows", "soft_max", "flash_attn"}))
    offloaded = logits_of(Model.load(path, [device, CPUBackend()], n_gpu_layers=99, numerics="f32"), PROMPT)
    np.testing.assert_allclose(offloaded, cpu, atol=1e-4, rtol=0)


def test_phi3_fused_matrices_load_as_their_rows(family_factory):
    """attn_qkv and ffn_up are loaded as attn_q/k/v and ffn_gate/up: rows of the stored matrix, in order."""
    path = family_factory(arch="phi3")
    model = Model.load(path, [CPUBackend()], numerics="f32")
    hp, w = model.hp, model.weights
    q, kv, ff = hp.n_head * hp.head_dim, hp.n_embd_kv, hp.n_ff
    stored = {name: model.gguf.load_f32(f"blk.0.{name}.weight") for name in ("attn_qkv", "ffn_up")}
    cpu = model.backends[-1]
    parts = {"attn_q": stored["attn_qkv"][:q], "attn_k": stored["attn_qkv"][q:q + kv],
             "attn_v": stored["attn_qkv"][q + kv:], "ffn_gate": stored["ffn_up"][:ff], "ffn_up": stored["ffn_up"][ff:]}
    for name, rows in parts.items():
        np.testing.assert_array_equal(cpu.array(w[f"blk.0.{name}.weight"]).view(np.float32).reshape(rows.shape), rows)
    assert "blk.0.attn_qkv.weight" not in w.tensors


def test_phi3_longrope_picks_its_factors_by_the_context(family_factory):
    """LongRoPE's short factors within the original context (64 tokens here), the long ones past it, as llama.cpp's
    get_rope_factors; the attention factor scales cos and sin (ops.Yarn without a ramp). tests/data holds
    llama.cpp's results for both (test_agrees_with_llama_cpp)."""
    model = Model.load(family_factory(arch="phi3+longrope_long"), [CPUBackend()])
    hp, w = model.hp, model.weights
    assert hp.extra["yarn"].ext_factor == 0.0 and hp.extra["yarn"].attn_factor == pytest.approx(1.1902)
    assert model.arch.rope_factors(w, hp, 64) is w["rope_factors_short.weight"]
    assert model.arch.rope_factors(w, hp, 65) is w["rope_factors_long.weight"]
    plain = Model.load(family_factory(arch="phi3"), [CPUBackend()])
    assert plain.arch.rope_factors(plain.weights, plain.hp, 1 << 20) is None and "yarn" not in plain.hp.extra


def test_phi3_longrope_k_shift_rotates_with_the_factors(family_factory):
    """Drop positions 0..3 of 12 cached tokens and move 4..11 down by 4: the K-shift re-rotates the keys with
    LongRoPE's factors, so layer 0's keys (token and position alone) are a fresh evaluation's at the new
    positions, times the attention factor: the shift's RoPE scales cos and sin by it once more, as llama.cpp's
    build_rope_shift does (ggml_rope_ext with the context's yarn_attn_factor)."""
    model = Model.load(family_factory(arch="phi3+longrope_long"), [CPUBackend()], numerics="f32")

    def session() -> Session:
        return Session(model, SessionParams(n_ctx=64, n_batch=64, type_k=DType.F32, type_v=DType.F32))

    def layer0_keys(s: Session, cells: slice) -> np.ndarray:
        return s.sched.cpu.array(s.kv.layers[0].k)[cells].copy()

    s = session()
    s.decode(Batch.of_sequence(PROMPT[:12]))
    s.seq_rm(0, 0, 4)
    s.seq_add(0, 4, -1, -4)
    s.decode(Batch.of_sequence(PROMPT[12:13], 8))
    fresh = session()
    fresh.decode(Batch.of_sequence(PROMPT[4:12]))
    scale = model.hp.extra["yarn"].attn_factor
    np.testing.assert_allclose(layer0_keys(s, slice(4, 12)), scale * layer0_keys(fresh, slice(0, 8)), atol=1e-5,
                               rtol=0)


def test_phi3_longrope_factors_move_the_logits(family_factory):
    """The same weights without LongRoPE (the plain phi3 model: no factors, no attention factor) give other
    logits."""
    def logits(arch: str) -> np.ndarray:
        return logits_of(Model.load(family_factory(arch=arch), [CPUBackend()], numerics="f32"), PROMPT)
    longrope, plain = logits("phi3+longrope_long"), logits("phi3")
    assert np.abs(longrope - plain).max() > 0.5


def test_qwen2_biases_are_added(family_factory):
    """The same model with its q/k/v biases removed (they are optional) gives other logits."""
    path = family_factory(arch="qwen2")
    bare = family_factory(arch="qwen2", edit=drop_biases)
    with_bias = logits_of(Model.load(path, [CPUBackend()], numerics="f32"), PROMPT)
    without = logits_of(Model.load(bare, [CPUBackend()], numerics="f32"), PROMPT)
    assert np.abs(with_bias - without).max() > 0.5


def reference_cases() -> list[str]:
    if not DATA.exists():
        return []
    return sorted(k for k in json.loads(DATA.read_text()) if "/" in k)


# What each weight type must reach against llama.cpp over the saved positions: the share ranked first alike,
# and the mean |log p| gap at llama.cpp's top token. The block types' models carry a bigram echo
# (loaders/synthetic.py QUANTIZED_OPTIONS) that keeps 8-bit activation rounding from deciding near ties.
BOUNDS = dict.fromkeys(("F32", "F16", "Q4_K", "IQ4_NL", "IQ4_XS", "MXFP4"), (0.98, 0.02))


@pytest.mark.parametrize("case", reference_cases())
def test_agrees_with_llama_cpp(family_factory, case):
    """llama.cpp's top token and its log-probability over the saved chunks of -c 128 (four, 63 scored positions each),
    as saved in llama-perplexity's format (log-probabilities quantized to 2.4e-4 nats): ggrun ranks the same
    token first and gives it llama.cpp's log-probability, within the weight type's BOUNDS."""
    ref = json.loads(DATA.read_text())[case]
    arch, type_name = case.split("/")
    path = family_factory(arch=arch) if type_name == "F32" else family_factory(arch=arch, weight_type=QT[type_name])
    model = Model.load(path, [CPUBackend()])
    plan = ChunkPlan(ref["n_ctx"], len(ref["tokens"]) // ref["n_ctx"])
    session = Session(model, SessionParams(n_ctx=plan.n_ctx, n_batch=plan.n_ctx, n_ubatch=plan.n_ctx))
    top, top_lp = [], []
    for chunk in evaluate_chunks(session, ref["tokens"], plan, plan.n_ctx, None):
        theirs = np.array(ref["top"][len(top):len(top) + len(chunk.logits)], dtype=np.int32)
        top += chunk.logits.argmax(axis=1).tolist()
        top_lp += (-token_nll(chunk.logits, theirs)).tolist()
    assert len(top) == len(ref["top"])
    same = np.mean(np.array(top) == np.array(ref["top"]))
    gap = np.abs(np.array(top_lp) - np.array(ref["top_logprob"])).mean()
    print(f"\n{case}: same top {same:.1%}, mean |log p(llama.cpp's top) - llama.cpp's| {gap:.5f}")
    min_same, max_gap = BOUNDS[type_name]
    assert same >= min_same
    assert gap < max_gap


def shrink_q_bias(tensors: dict) -> None:
    tensors["blk.1.attn_q.bias"] = tensors["blk.1.attn_q.bias"][:-1]


def drop_qkv(tensors: dict) -> None:
    del tensors["blk.0.attn_qkv.weight"]


@pytest.mark.parametrize("arch, options, expected", [
    ("qwen2", {"edit": shrink_q_bias}, "tensor blk.1.attn_q.bias has shape [255], expected [n_head * head_dim] = [256]"),
    ("phi3", {"edit": drop_qkv}, "missing tensor blk.0.attn_qkv.weight"),
    ("phi3+longrope_long", {"edit": shrink_rope_factors},
     "tensor rope_factors_long.weight has shape [31] and type F32, expected F32 [n_rot / 2] = [32]"),
    ("qwen3moe", {"extra_metadata": (("qwen3moe.expert_used_count", 9),)},
     "qwen3moe.expert_used_count = 9, expected at most qwen3moe.expert_count (8)"),
    ("qwen3moe", {"extra_metadata": (("qwen3moe.expert_count", 0),)}, "qwen3moe.expert_count = 0, expected an integer"),
    ("gemma2", {"extra_metadata": (("gemma2.final_logit_softcapping", 0.0),)},
     "gemma2.final_logit_softcapping = 0, expected a finite number above 0"),
])
def test_a_bad_family_file_is_one_line(family_factory, arch, options, expected):
    """Each family's own keys and tensor table are checked before anything loads."""
    path = family_factory(arch=arch, **options)
    with open_gguf(path) as gf, pytest.raises(BadInput) as info:
        Model.read_hparams(gf)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert expected in message, message


@pytest.mark.parametrize("arch", FAMILIES)
def test_offloaded_to_a_device_the_logits_stay(family_factory, arch):
    """Every layer and the head on the stand-in device (SIM: the reference kernels, as a backend without the
    CPU's compiled ones): the same logits as on the CPU, f32 numerics."""
    from ggrun.core.backends.sim import SimBackend
    path = family_factory(arch=arch)
    on_cpu = logits_of(Model.load(path, [CPUBackend()], numerics="f32"), PROMPT)
    model = Model.load(path, [SimBackend(), CPUBackend()], 99, numerics="f32")
    assert model.placement.output is not model.placement.input
    np.testing.assert_allclose(logits_of(model, PROMPT), on_cpu, atol=2e-3, rtol=0)
