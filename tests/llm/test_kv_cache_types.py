"""KV cache types (llama.cpp's -ctk / -ctv: f16, f32, q8_0, q4_0) through whole sessions on synthetic
tiny llama and gemma3 models with heads of 64: quantized caches give logits close to an f16 cache's,
the CPU's kernels agree with the reference kernels, the unfused path reads quantized keys, the
K-shift re-rotates a quantized K cache, the bytes planned are the bytes taken, llama.cpp's rules
refuse what it refuses, and the first-run warm-up compiles every kernel these caches use. The slow
test compares SmolLM2's greedy text with llama-completion's for the same cache types."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.op_harness import ReferenceBackend, nmse
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.kv_cache import KVCache, planned_bytes, rotation_size
from ggrun.core.llm.memory import measure
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.core.quants import dequantize
from ggrun.loaders.synthetic import write_tiny_gemma3, write_tiny_llama, written_once

F16, F32, Q8_0, Q4_0 = DType.F16, DType.F32, DType.Q8_0, DType.Q4_0
PROMPT = [104, 101, 108, 108, 111, 256, 263, 32, 119, 275, 10, 66, 200, 7, 268, 258, 111, 33, 120, 99]
# NMSE of the logits against an f16 cache's on these random tiny models (measured: q8_0 1.2e-4 to
# 1.6e-4, q4_0 0.6e-2 to 2.6e-2): a cache that stored garbage, or lost the rotation, lands far above
NMSE_VS_F16 = {Q8_0: 1e-3, Q4_0: 6e-2}
DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """Tiny models whose heads hold 64 values (two Q8_0 / Q4_0 blocks, one rotation of 64)."""
    llama = written_once(write_tiny_llama, tmp_path_factory.mktemp, "kv_llama")
    gemma = written_once(write_tiny_gemma3, tmp_path_factory.mktemp, "kv_gemma3")
    return {"llama": llama(n_embd=256, n_head=4, n_head_kv=2, weight_type=QT.F32), "gemma3": gemma(head_dim=64)}


@pytest.fixture(scope="module")
def models(paths) -> dict[str, Model]:
    return {arch: Model.load(path, [CPUBackend()]) for arch, path in paths.items()}


def make_session(model: Model, type_k: DType, type_v: DType, flash_attn: bool = True, n_ubatch: int = 7,
                 n_ctx: int = 64) -> Session:
    return Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch, type_k=type_k, type_v=type_v,
                                        flash_attn=flash_attn))


def logits_of(session: Session, tokens: list[int], pos0: int = 0) -> np.ndarray:
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, pos0 + i, 0, True)
    return session.decode(b)


PAIRS = [(Q8_0, Q8_0), (Q4_0, Q4_0), (Q8_0, F16), (F16, Q4_0), (Q4_0, Q8_0)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("type_k,type_v", PAIRS, ids=lambda t: str(t))
def test_quantized_caches_stay_close_to_f16(models, arch, type_k, type_v):
    """Prompt in micro-batches of 7, then decode steps: logits near an f16 cache's, by the coarser type's
    bound; the cache holds blocks (its rows take the block sizes)."""
    model = models[arch]
    want = logits_of(make_session(model, F16, F16), PROMPT)
    s = make_session(model, type_k, type_v)
    got = logits_of(s, PROMPT)
    coarse = Q4_0 if Q4_0 in (type_k, type_v) else Q8_0
    assert 0 < nmse(got, want) < NMSE_VS_F16[coarse]
    rows = next(iter(s.kv.layers.values()))
    assert (rows.k.dtype, rows.v.dtype) == (type_k, type_v)
    assert rows.k.nbytes == 64 * type_k.row_bytes(model.hp.n_embd_kv)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cpu_kernels_agree_with_the_reference_kernels(paths, models, arch):
    """The same session on the CPU backend and on the numpy reference kernels alone: the compiled
    writes, attention and K-shift against the reference's, through whole models."""
    ref_model = Model.load(paths[arch], [ReferenceBackend()])
    for type_k, type_v in [(Q8_0, Q8_0), (Q4_0, F16)]:
        got = logits_of(make_session(models[arch], type_k, type_v), PROMPT)
        want = logits_of(make_session(ref_model, type_k, type_v), PROMPT)
        assert nmse(got, want) < 1e-4, (type_k, type_v)


@pytest.mark.parametrize("type_k", [Q8_0, Q4_0])
def test_unfused_attention_reads_quantized_keys(models, type_k):
    """-no-fa with a quantized K (V stays f16, as llama.cpp requires): the products against the rotated
    blocks give the fused attention's logits."""
    model = models["llama"]
    fused = logits_of(make_session(model, type_k, F16), PROMPT)
    unfused = logits_of(make_session(model, type_k, F16, flash_attn=False), PROMPT)
    assert nmse(unfused, fused) < 1e-4


def test_caches_carry_llama_cpps_rotation_sizes(models):
    assert [rotation_size(t, 64, True) for t in (F16, F32, Q8_0, Q4_0)] == [0, 0, 64, 64]
    assert rotation_size(Q8_0, 256, True) == 256 and rotation_size(Q8_0, 256, False) == 64
    assert rotation_size(Q4_0, 96, True) == 0  # 64 does not divide the head: no rotation
    s = make_session(models["gemma3"], Q8_0, Q4_0)
    for cache in s.caches:  # the window layers' own cache too (iSWA)
        rows = next(iter(cache.layers.values()))
        assert rows.k.params["hadamard"] == 64 and rows.v.params["hadamard"] == 64
        assert rows.k.params["act_quant"] == "q8_0" and "act_quant" not in rows.v.params


def test_k_shift_re_rotates_a_quantized_k_cache(models):
    """Drop positions 0..3 of 12 cached tokens and move 4..11 down by 4: layer 0's keys (which depend only
    on token and position) decode to a fresh evaluation's at the new positions, within the rounding of
    quantizing twice; decoding goes on near an f16 cache's after the same shift."""
    model = models["llama"]
    hp = model.hp
    runs = {}
    for type_k in (Q8_0, F16):
        s = make_session(model, type_k, F16)
        logits_of(s, PROMPT[:12])
        s.seq_rm(0, 0, 4)
        s.seq_add(0, 4, -1, -4)
        runs[type_k] = (s, logits_of(s, PROMPT[12:16], pos0=8))
    s, got = runs[Q8_0]
    assert s.kv.pos[4:12].tolist() == list(range(8))
    assert nmse(got, runs[F16][1]) < NMSE_VS_F16[Q8_0]
    fresh = make_session(model, Q8_0, F16)
    logits_of(fresh, PROMPT[4:12])
    width = hp.n_embd_kv
    shifted = s.sched.cpu.array(s.kv.layers[0].k)[4:12]
    want = fresh.sched.cpu.array(fresh.kv.layers[0].k)[:8]
    decoded = [dequantize(np.ascontiguousarray(x).reshape(-1), "Q8_0", (8, width)) for x in (shifted, want)]
    assert nmse(*decoded) < 1e-4
    assert not np.array_equal(shifted, s.sched.cpu.array(fresh.kv.layers[0].k)[4:12])


def test_planned_bytes_are_the_bytes_taken(models, paths):
    """Whole blocks per row for quantized types: what the session checks before allocating, what it
    allocates, and what `ggrun measure` reports."""
    model = models["llama"]
    hp = model.hp
    s = make_session(model, Q8_0, Q4_0, n_ctx=256)
    per_layer = 256 * (Q8_0.row_bytes(hp.n_embd_kv) + Q4_0.row_bytes(hp.n_embd_kv))
    assert s.kv_bytes_by_backend() == {"CPU": hp.n_layer * per_layer}
    assert planned_bytes(256, hp.n_embd_kv, [CPUBackend()] * hp.n_layer, Q8_0, Q4_0) == {"CPU": hp.n_layer * per_layer}
    virtual = Model.load(paths["llama"], [CPUBackend()], metadata_only=True)
    records = measure(virtual, 256, 64, 256, 1, flash_attn=True, type_k=Q8_0, type_v=Q4_0)
    assert {r.kv_bytes for r in records} == {hp.n_layer * per_layer}


def test_llama_cpps_rules_for_cache_types(models, tiny_llama_path):
    model = models["llama"]
    with pytest.raises(BadInput, match="needs flash attention"):
        make_session(model, F16, Q8_0, flash_attn=False)
    with pytest.raises(BadInput, match="not supported"):
        make_session(model, DType.Q4_1, F16)
    small_heads = Model.load(tiny_llama_path, [CPUBackend()])  # heads of 16: not whole blocks of 32
    with pytest.raises(BadInput, match="do not divide the model's head size 16"):
        make_session(small_heads, Q8_0, Q8_0)
    make_session(small_heads, F32, F16)  # plain types of two kinds are fine

    class NoCacheWrites(CPUBackend):
        """A device that leaves quantized cache writes to the CPU (as the CUDA backend does)."""

        name = "GPU-like"

        def supports_op(self, node):
            return not node.dtype.is_quantized

    with pytest.raises(BadInput, match="q8_0 KV cache .-ctk q8_0. cannot live on GPU-like"):
        KVCache(64, 128, [NoCacheWrites()], type_k=Q8_0, type_v=F16, head_dim=64)
    KVCache(64, 128, [NoCacheWrites()], type_k=F16, type_v=F16, head_dim=64)


def test_warm_up_compiles_every_kernel_quantized_caches_use(models):
    """After the warm-up graphs ran, a session with quantized caches (prompt, decode steps, a K-shift,
    both attention paths) compiles nothing more in the kernels those caches use."""
    from ggrun.core.backends.cpu import attention, elementwise, precompile, rope, warmup

    backend = CPUBackend()
    for warm in precompile.selected(frozenset({warmup.kv(Q8_0), warmup.kv(Q4_0), warmup.kv(F16)})):
        precompile.run(backend, warm)
    kernels = [attention.flash_attn_cells_serial, attention.flash_attn_cells_parallel, rope.rope_store_blocks,
               rope.rope_shift_rows, elementwise.scatter_blocks]
    before = {k: set(k.signatures) for k in kernels}
    model = models["gemma3"]
    for type_k, type_v, fa in [(Q8_0, Q4_0, True), (Q4_0, F16, False)]:
        s = make_session(model, type_k, type_v, flash_attn=fa, n_ubatch=64)
        logits_of(s, PROMPT)
        logits_of(s, [5], pos0=len(PROMPT))
        s.seq_add(0, 2, -1, 3)
        logits_of(s, [6], pos0=len(PROMPT) + 4)
    assert {k: set(k.signatures) for k in kernels} == before


@pytest.mark.slow
def test_smollm2_greedy_text_matches_llama_completion(smollm2):
    """SmolLM2's greedy continuation with quantized caches equals llama-completion's for the same -ctk /
    -ctv (tests/data/kv_quant_smollm2.json says how it was made) up to the reference's first near-tie,
    where llama.cpp's top two logits (with these caches) were within 0.2 of each other."""
    from ggrun.core.llm.generate import generate
    from ggrun.core.llm.sampling import Sampler, SamplingParams

    ref = json.loads((DATA / "kv_quant_smollm2.json").read_text(encoding="utf-8"))
    prompt = smollm2.tokenizer.tokenize(ref["prompt"], add_special=True, parse_special=True)
    for case in ref["cases"]:
        s = Session(smollm2, SessionParams(n_ctx=2048, n_batch=512, n_ubatch=512, type_k=DType[case["ctk"].upper()],
                                           type_v=DType[case["ctv"].upper()]))
        out, _ = generate(s, prompt, ref["n_predict"], Sampler(SamplingParams(temp=0)), lambda t: None, ignore_eos=True)
        text = smollm2.tokenizer.detokenize(out)
        safe = case["safe_text"]
        print(f"\n-ctk {case['ctk']} -ctv {case['ctv']}: {text!r}\n  llama-completion: {case['text']!r}")
        assert text.startswith(safe), (case["ctk"], case["ctv"])
