"""ggrun's CUDA C kernels: the .cu sources beside this file, compiled (with common.cuh in front) through
cupy's RawModule, whose on-disk cache keeps the compiled code between runs: once per source and group of
template instances (module), the first time one of the group's kernels is asked for, never per call.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import cupy

HERE = Path(__file__).parent
OPTIONS = ("-std=c++17", "--use_fast_math")
# sources whose f32 arithmetic must round as numpy's does (sampling draws the reference's tokens): IEEE
# division and exp, no contraction of a product and a sum into one rounding
EXACT_OPTIONS = ("-std=c++17", "--fmad=false")
SOURCE_OPTIONS = {"sample.cu": EXACT_OPTIONS}

# ggml's type numbers, as the kernels' template arguments spell them (common.cuh)
TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10,
            "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30, "MXFP4": 39}
FLOATS = ("F32", "F16", "BF16")
# decode products: q8_1 activations, __dp4a
DP4A_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
              "MXFP4")
GEMV_COLS = (1, 2, 4, 8)  # token rows one product kernel serves; other counts are sums of these
# products of a few dozen token rows on int8 tensor cores (mmq; a scale per 32 weights)
MMQ_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "IQ4_NL", "MXFP4")
MMQ_TILES = (2, 4, 8)  # groups of 8 token rows an mmq block serves
# mmqt's and mmq_idt's tiles (matmul.cu): (WM, NT), a block of 16 WM weight rows by 8 NT (8 / WM) token rows
MT_TILES = ((8, 2), (8, 4), (8, 8), (4, 1), (4, 2), (4, 4), (4, 8), (2, 1), (2, 2), (2, 4))
# mmq_idt's: 128 weight rows of an expert by 16 or 32 of its slots. On an H100 a Qwen3-30B-A3B-shaped Q4_K model's
# 512-token prompt took 39.6 ms with these against 45.2 with 64-row tiles of 16, 32 or 64 slots (stop 48, the
# same process, mmq_idt taking tiles from moe_group's list); before that list, 128-row tiles lost in the model,
# whose skewed routing left a busy expert's tiles to few blocks.
MT_ID_TILES = ((8, 2), (8, 4))
FA_EPL = (1, 2, 4, 8)  # head-dimension elements per lane of flash_attn (head dims up to 256)
NO_WEIGHT = -1
DECODE_DIMS = (64, 128, 256)  # head dimensions attn_decode is built for
TC_DIMS = (64, 128)  # head dimensions flash_attn_tc (prompt attention on tensor cores) is built for
GLU_ACTS = {"swiglu": 1, "geglu": 2}  # glu_act's template argument (common.cuh)
# glu_pair's (common.cuh): the gated units the experts' kernels end with, gpt-oss's too
EXPERT_GLU_ACTS = GLU_ACTS | {"swiglu_oai": 3}


def _t(name: str) -> int:
    return TYPE_IDS[name]


def _instances() -> dict[str, list[str]]:
    """The template instantiations each source provides (NVRTC compiles only what is named)."""
    weights = list(TYPE_IDS)
    norm_w = [NO_WEIGHT] + [_t(f) for f in FLOATS]
    return {
        "matmul.cu": [f"mmvq<{_t(q)}, {c}>" for q in DP4A_TYPES for c in GEMV_COLS]
        + [f"mmvq_bias<{_t(q)}, {c}>" for q in DP4A_TYPES for c in GEMV_COLS]
        + [f"mmvq_rope_qkv<{_t(q)}, {_t(d)}>" for q in DP4A_TYPES for d in FLOATS]
        + [f"mmvq_glu<{_t(q)}, {c}, {f}>" for q in DP4A_TYPES for c in GEMV_COLS for f in GLU_ACTS.values()]
        + [f"gemv<{_t(q)}, {c}>" for q in weights for c in GEMV_COLS]
        + [f"gemv_bias<{_t(f)}, {c}>" for f in FLOATS for c in GEMV_COLS]
        + [f"mmq<{_t(q)}, {nt}>" for q in MMQ_TYPES for nt in MMQ_TILES]
        + [f"mmqt<{_t(q)}, {wm}, {nt}>" for q in MMQ_TYPES for wm, nt in MT_TILES]
        + [f"mmq_idt<{_t(q)}, {wm}, {nt}>" for q in MMQ_TYPES for wm, nt in MT_ID_TILES]
        + [f"mmvq_id<{_t(q)}>" for q in DP4A_TYPES] + [f"mmid_tc<{_t(q)}>" for q in weights]
        + [f"mmvq_id_glu<{_t(q)}, {f}>" for q in DP4A_TYPES for f in GLU_ACTS.values()]
        + [f"mmvq_id_bias<{_t(q)}>" for q in DP4A_TYPES]
        + [f"mmvq_id_glu_bias<{_t(q)}, {f}>" for q in DP4A_TYPES for f in EXPERT_GLU_ACTS.values()]
        + [f"dequant_f16<{_t(q)}>" for q in weights] + [f"dequant_f16_x8<{_t(q)}>" for q in weights]
        + [f"get_rows<{_t(q)}>" for q in weights]
        + [f"mul_mat_float<{_t(a)}, {_t(b)}>" for a in FLOATS for b in FLOATS],
        "norm.cu": [f"rms_norm<{w}>" for w in norm_w]
        + [f"add_rms_norm<{_t(w)}, {p}>" for w in FLOATS for p in ("false", "true")],
        "rope.cu": [f"rope<{w}>" for w in norm_w] + [f"rope_ff<{w}>" for w in norm_w]
        + [f"rope_bias<{w}>" for w in norm_w]
        + [f"rope_set_rows<{w}, {_t(d)}>" for w in norm_w for d in FLOATS]
        + [f"rope_set_rows_bias<{w}, {_t(d)}>" for w in norm_w for d in FLOATS]
        + [f"rope_qkv<{w}, {_t(d)}>" for w in norm_w for d in FLOATS],
        "elementwise.cu": [f"copy4<{_t(s)}, {_t(d)}>" for s in FLOATS for d in FLOATS]
        + [f"binary4<{op}, {_t(a)}, {_t(b)}>" for op in (0, 1) for a in FLOATS for b in FLOATS]
        + [f"unary4<{f}>" for f in (0, 1, 2)] + [f"gated<{f}>" for f in (1, 2)]
        + [f"set_rows<{_t(d)}>" for d in FLOATS] + [f"set_rows_bias<{_t(d)}>" for d in FLOATS]
        + [f"soft_max<{m}>" for m in (NO_WEIGHT, 0, 1)],
        "attention.cu": [f"flash_attn<{_t(k)}, {e}>" for k in FLOATS for e in FA_EPL]
        + [f"attn_decode{rows}<{_t(k)}, {d}>" for rows in ("", "_rows", "_tok") for k in FLOATS for d in DECODE_DIMS]
        + [f"flash_attn_tc<{d}, {p}>" for d in TC_DIMS for p in ("false", "true")],
    }


INSTANCES = _instances()


def _group(name: str) -> str:
    """The module an instance is compiled in: its first template argument (a weight's or cache's type, a
    norm's weight, ...), '' for a plain kernel."""
    return name.split("<", 1)[1].split(",", 1)[0].strip(" >") if "<" in name else ""


@lru_cache(maxsize=None)
def module(source: str, group: str = "") -> cupy.RawModule:
    """`source` compiled with the instances of one group (_group), so a model compiles only the instances of
    the types it holds: all 541 of matmul.cu took ~80 s (nvcc 13, sm_90), and a fresh GPU machine's first
    run spent ~100 s compiling; Q4_0's 40 take ~5 s. The plain kernels are in every group's module."""
    code = (HERE / "common.cuh").read_text() + "\n" + (HERE / source).read_text()
    names = [n for n in INSTANCES.get(source, []) if _group(n) == group]
    return cupy.RawModule(code=code, options=SOURCE_OPTIONS.get(source, OPTIONS), name_expressions=names or None)


@lru_cache(maxsize=None)
def kernel(source: str, name: str) -> cupy.RawKernel:
    """Kernel `name` (a plain name, or a template instance spelled as in INSTANCES) of `source`."""
    return module(source, _group(name)).get_function(name)
