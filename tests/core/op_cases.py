"""One list of op cases for every backend, as llama.cpp's test-backend-ops keeps one: each case is a small
graph (shapes, types and odd sizes chosen to catch a kernel's edge cases) that tests/core/test_backend_ops.py
runs on every usable backend (CPU, SIM, each CUDA device) and compares with the reference kernels by NMSE.

A case draws its data from a generator seeded by its id, so every backend computes the same numbers.
`native` names the backends whose own kernels must take the case (a compiled CPU kernel for the output
node, no cupy fallback on CUDA): those the case was written for; elsewhere only the result is checked.
`fused` names the step of a fused kernel the CUDA backend must run for the graph (its unfused nodes built
as a model builds them): a fusion the case was written for.
Tolerances are per kind of op and backend (CUDA's exp and fast division differ from numpy's in the
last bits).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggrun.core import ops
from ggrun.core.backends.op_harness import TYPES, Leafs, cache_attention, weight_data
from ggrun.core.dtypes import DType
from ggrun.core.llm.blocks import expert_product, weighted_sum
from ggrun.core.ops import ROPE_NEOX, ROPE_NORMAL
from ggrun.core.quants import vec_dot_blocks

F32, F16, I32 = DType.F32, DType.F16, DType.I32
Build = Callable[[Leafs], object]

CPU, CUDA = frozenset({"CPU"}), frozenset({"CUDA"})
BOTH = CPU | CUDA

# NMSE allowed per kind of op and backend kind (test-backend-ops' values where it has them)
ELEMENTWISE = {"CPU": 1e-7, "CUDA": 1e-6}
GATED = {"CPU": 1e-7, "CUDA": 1e-5}
ROPE = {"CPU": 1e-7, "CUDA": 1e-6}
EXACT = {"CPU": 1e-12, "CUDA": 1e-12}
ATTENTION = {"CPU": 5e-4, "CUDA": 5e-4}
MUL_MAT = {"CPU": 5e-4, "CUDA": 5e-4}
GLU = {"CPU": 1e-3, "CUDA": 1e-3}  # two products' 8-bit activation error, multiplied through the gate
# swiglu_oai over random Q4_K blocks: products of ~100 where its clamp is 7; q8_1 activations alone give an NMSE of
# 1e-4 to 9e-4 there (numpy, four seeds), the H200 1.1e-3 to 3.2e-3 (the CPU's q8_K blocks stay below 1e-3)
GLU_OAI_Q4_K = {"CPU": 1e-3, "CUDA": 5e-3}


@dataclass(frozen=True)
class OpCase:
    """One graph: `make(rng)` draws its data and returns the builder the harness calls per backend."""

    id: str
    make: Callable[[np.random.Generator], Build]
    tolerance: dict[str, float]
    native: frozenset[str] = BOTH
    fused: str = ""

    def build(self) -> Build:
        return self.make(np.random.default_rng(zlib.crc32(self.id.encode())))

    def max_nmse(self, kind: str) -> float:
        """The case's bound on a backend of this kind (SIM runs the reference kernels: the strictest)."""
        return self.tolerance.get(kind, min(self.tolerance.values()))


def values(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def positions(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.sort(rng.choice(2048, size=n, replace=False)).astype(np.int32)


def causal_mask(n: int, n_kv: int, used: int, rows: int | None = None, window: int | None = None) -> np.ndarray:
    """f16 [rows >= n, n_kv]: token t (at position used - n + t) sees cells up to its position
    (within `window` when given); cells from `used` on are padding; padding rows are garbage."""
    m = np.full((rows or n, n_kv), -np.inf, dtype=np.float32)
    for t in range(n):
        p = used - n + t
        lo = 0 if window is None else max(0, p - window + 1)
        m[t, lo:p + 1] = 0
    m[n:] = 3.0  # rows past the tokens: a kernel that reads them is wrong
    return m.astype(np.float16)


# ---- weight products -------------------------------------------------------------------------

def _mul_mat(dtype: DType, m: int, n_tokens: int):
    def make(rng):
        k = 512 if dtype.block_size == 256 else 96
        data, x = weight_data(dtype, m, k, seed=int(rng.integers(1 << 30))), values(rng, n_tokens, k)
        return lambda lf: ops.mul_mat(lf.weight("w", dtype, (m, k), data), lf.input("x", F32, x))
    return make


def _get_rows_stored(dtype: DType, n_rows: int, width: int | None = None, ids: list[int] | None = None):
    def make(rng):
        k = width or (512 if dtype.block_size == 256 else 96)
        data = weight_data(dtype, n_rows, k, seed=int(rng.integers(1 << 30)))
        idx = np.array(ids, dtype=np.int32) if ids else rng.integers(0, n_rows, size=2).astype(np.int32)
        return lambda lf: ops.get_rows(lf.weight("e", dtype, (n_rows, k), data), lf.input("ids", I32, idx))
    return make


def _attention_products(kv_dtype: DType):
    """Without the fused op: scores from a grouped-query cache view."""
    def make(rng):
        kd, qd = values(rng, 100, 2 * 16).astype(kv_dtype.np_dtype), values(rng, 3, 4, 16)

        def build(lf):
            cache = lf.weight("k", kv_dtype, (100, 32), kd)
            k = ops.permute(ops.view(cache, (100, 2, 16)), (1, 0, 2))
            q = ops.permute(lf.input("q", F32, qd), (1, 0, 2))
            return ops.mul_mat(k, ops.cont(q))
        return build
    return make


def _mul_mat_multi(kinds: tuple[tuple[DType, int], ...], n_tokens: int):
    """q, k and v (or gate and up) from one activation: weights of different types and heights."""
    def make(rng):
        k = 256
        data = [weight_data(dt, m, k, seed=i) for i, (dt, m) in enumerate(kinds)]
        x = values(rng, n_tokens, k)

        def build(lf):
            ws = tuple(lf.weight(f"w{i}", dt, (m, k), d) for i, ((dt, m), d) in enumerate(zip(kinds, data)))
            views = ops.mul_mat_multi(ws, lf.input("x", F32, x), tuple(f"p{i}" for i in range(len(ws))))
            flat = views[0].view_src  # every product, one after another
            return ops.add(flat, flat)
        return build
    return make


def _mul_mat_glu(types: tuple[DType, DType], n_tokens: int, glu: str):
    def make(rng):
        m, k = 96, 256
        gd, ud = (weight_data(dt, m, k, seed=i) for i, dt in enumerate(types))
        x = values(rng, n_tokens, k)

        def build(lf):
            gate, up = lf.weight("gate", types[0], (m, k), gd), lf.weight("up", types[1], (m, k), ud)
            return ops.mul_mat_glu(gate, up, lf.input("x", F32, x), glu)
        return build
    return make


def _mul_mat_bias(dtype: DType, m: int, n_tokens: int, bias_shape: tuple[int, ...] | None = None):
    """A product and the add of a bias vector after it (attention's output projection, a router)."""
    def make(rng):
        k = 512 if dtype.block_size == 256 else 96
        data, x = weight_data(dtype, m, k, seed=int(rng.integers(1 << 30))), values(rng, n_tokens, k)
        bd = values(rng, *(bias_shape or (m,)), scale=2.0)
        return lambda lf: ops.add(ops.mul_mat(lf.weight("w", dtype, (m, k), data), lf.input("x", F32, x)),
                                  lf.weight("b", F32, bd.shape, bd))
    return make


def _mul_mat_multi_bias(kinds: tuple[tuple[DType, int], ...], n_tokens: int, part: int):
    """q, k and v from one activation, then the bias add of one of them (as blocks.project_qkv has it)."""
    def make(rng):
        k = 256
        data = [weight_data(dt, m, k, seed=i) for i, (dt, m) in enumerate(kinds)]
        x, bd = values(rng, n_tokens, k), values(rng, kinds[part][1], scale=2.0)

        def build(lf):
            ws = tuple(lf.weight(f"w{i}", dt, (m, k), d) for i, ((dt, m), d) in enumerate(zip(kinds, data)))
            views = ops.mul_mat_multi(ws, lf.input("x", F32, x), tuple(f"p{i}" for i in range(len(ws))))
            return ops.add(views[part], lf.weight("b", F32, bd.shape, bd))
        return build
    return make


def product_cases() -> list[OpCase]:
    cases = [OpCase(f"mul_mat-{t}-n{n}", _mul_mat(t, 67, n), MUL_MAT) for t in TYPES for n in (1, 2, 3, 7, 8, 9, 16, 17, 64, 100)]
    cases += [OpCase(f"mul_mat-beyond-65535-rows-n{n}", _mul_mat(DType.Q4_0, 70_001, n), MUL_MAT) for n in (1, 512)]
    cases += [OpCase(f"get_rows-{t}", _get_rows_stored(t, 40, ids=[3, 0, 39, 3, 17]), ELEMENTWISE) for t in TYPES]
    cases += [OpCase(f"attention-products-{t}", _attention_products(t), MUL_MAT, CUDA) for t in (F16, F32)]
    multi = {"mixed": ((DType.Q4_0, 96), (DType.Q6_K, 32), (DType.F16, 40)),
             "one-type": ((DType.Q4_0, 96), (DType.Q4_0, 32), (DType.Q4_0, 40)),
             "two-pairs": ((DType.Q8_0, 64), (DType.Q8_0, 32), (DType.Q4_1, 32), (DType.Q4_1, 8)),
             "three-types": ((DType.Q8_0, 96), (DType.Q4_K, 32), (DType.MXFP4, 40))}
    cases += [OpCase(f"mul_mat_multi-{name}-n{n}", _mul_mat_multi(kinds, n), MUL_MAT)
              for name, kinds in multi.items() for n in (1, 7, 64)]
    glu_types = [(DType.Q4_0, DType.Q4_0), (DType.Q8_0, DType.Q8_0), (DType.Q6_K, DType.Q6_K), (DType.Q4_0, DType.Q8_0),
                 (DType.MXFP4, DType.MXFP4), (DType.IQ4_XS, DType.IQ4_XS)]
    cases += [OpCase(f"mul_mat_glu-{glu}-{g}-{u}-n{n}", _mul_mat_glu((g, u), n, glu), GLU)
              for glu in ("swiglu", "geglu") for g, u in glu_types for n in (1, 3, 8, 9, 64)]
    cases += [OpCase(f"mul_mat-bias-{t}-n{n}", _mul_mat_bias(t, 67, n), MUL_MAT, fused="mul_mat+bias")
              for t in (F16, DType.Q8_0, DType.MXFP4, F32) for n in (1, 2, 3, 5, 8)]
    cases.append(OpCase(f"mul_mat-bias-row-{DType.Q4_K}-n1", _mul_mat_bias(DType.Q4_K, 40, 1, (1, 40)), MUL_MAT,
                        fused="mul_mat+bias"))
    cases += [OpCase(f"mul_mat-bias-{t}-n{n}-beyond-decode", _mul_mat_bias(t, 67, n), MUL_MAT)
              for t in (DType.Q8_0, DType.MXFP4) for n in (9, 40)]
    cases += [OpCase(f"mul_mat_multi-bias-{name}-part{j}-n{n}", _mul_mat_multi_bias(multi[name], n, j), MUL_MAT,
                     fused="mul_mat_multi+bias" if n <= 8 else "")
              for name, j in (("one-type", 2), ("one-type", 0), ("three-types", 0), ("three-types", 1), ("mixed", 2))
              for n in (1, 3, 8, 9)]
    return cases


# ---- norms -----------------------------------------------------------------------------------

def _rms_norm_mul(shape: tuple[int, ...], w_len: int, scale: float = 1.0):
    def make(rng):
        xd, wd = values(rng, *shape, scale=scale), values(rng, w_len)
        return lambda lf: ops.rms_norm_mul(lf.input("x", F32, xd), lf.weight("w", F32, wd.shape, wd), 1e-6)
    return make


def _norm(op, shape: tuple[int, int]):
    def make(rng):
        xd = values(rng, *shape, scale=3.0)
        return lambda lf: op(lf.input("x", F32, xd), 1e-5)
    return make


def _add_rms_norm(n: int, width: int, post: bool):
    def make(rng):
        xd, hd = values(rng, n, width), values(rng, n, width, scale=3.0)
        wd, pd = values(rng, width), values(rng, width)

        def build(lf):
            p = lf.weight("p", F32, pd.shape, pd) if post else None
            return ops.add_rms_norm(lf.input("x", F32, xd), lf.input("h", F32, hd), lf.weight("w", F32, wd.shape, wd),
                                    1e-6, post=p)
        return build
    return make


def norm_cases() -> list[OpCase]:
    shapes = {(1, 576): BOTH, (2, 577): CPU, (7, 64): BOTH, (33, 13): BOTH, (512, 576): CPU, (512, 2048): CUDA}
    cases = [OpCase(f"rms_norm_mul-{a}x{b}", _rms_norm_mul((a, b), b), ELEMENTWISE, on)
             for (a, b), on in shapes.items()]
    cases.append(OpCase("rms_norm_mul-per-head-weight", _rms_norm_mul((7, 3, 32), 32, scale=5.0), ELEMENTWISE, CPU))
    cases.append(OpCase("rms_norm", _norm(ops.rms_norm, (33, 577)), ELEMENTWISE))
    cases.append(OpCase("norm", _norm(ops.norm, (33, 577)), ELEMENTWISE, CUDA))
    cases += [OpCase(f"add_rms_norm-{'post' if post else 'llama'}-n{n}-{w}", _add_rms_norm(n, w, post), ELEMENTWISE,
                     CUDA if w == 640 else CPU)
              for post in (False, True) for n, w in ((1, 577), (2, 577), (7, 577), (33, 577), (7, 640))]
    return cases


# ---- rope and the cache ----------------------------------------------------------------------

ROPES = [(ROPE_NORMAL, 64, 64, 10000.0, 1.0), (ROPE_NEOX, 32, 32, 1e6, 1.0), (ROPE_NEOX, 48, 64, 10000.0, 0.25),
         (ROPE_NORMAL, 6, 10, 500.0, 1.0)]


def _rope(n: int, heads: int, mode: int, n_dims: int, d: int, base: float, fscale: float,
          pos: list[int] | None = None, norm: bool = False):
    """RoPE of n tokens' heads; with `norm`, the heads normed first and scaled after (one node)."""
    def make(rng):
        xd, wd = values(rng, n, heads, d, scale=2.0), values(rng, d)
        p = np.array(pos, dtype=np.int32) if pos else positions(rng, n)

        def build(lf):
            w = lf.weight("w", F32, wd.shape, wd) if norm else None
            return ops.rope(lf.input("x", F32, xd), lf.input("pos", I32, p), n_dims, mode, base, fscale,
                            out_scale=0.125 if norm else 1.0, norm=w, eps=1e-6)
        return build
    return make


def _rope_freq_factors(n: int, mode: int, norm: bool, longrope: bool):
    """RoPE with frequency factors dividing each pair's angle (Llama 3's rope_freqs), or Phi-3's LongRoPE (neox,
    and an attention factor scaling cos and sin): the CPU's rope_rows, CUDA's rope_ff."""
    def make(rng):
        xd, wd, p = values(rng, n, 3, 64, scale=2.0), values(rng, 64), positions(rng, n)
        factors = np.geomspace(1.0, 16.0, 32).astype(np.float32)
        yarn = ops.Yarn(0.0, 1.19, 32.0, 1.0, 4096) if longrope else None

        def build(lf):
            w = lf.weight("w", F32, wd.shape, wd) if norm else None
            return ops.rope(lf.input("x", F32, xd), lf.input("pos", I32, p), 64, mode, 10000.0, 1.0, norm=w,
                            eps=1e-6, yarn=yarn, factors=lf.weight("factors", F32, factors.shape, factors))
        return build
    return make


def _rope_fused_norm(n: int, mode: int, d: int, base: float, out_scale: float):
    """gemma3's queries: per-head norm, RoPE, then the attention scale, in one node."""
    def make(rng):
        xd, wd, pos = values(rng, n, 4, d, scale=4.0), values(rng, d), positions(rng, n)
        return lambda lf: ops.rope(lf.input("x", F32, xd), lf.input("pos", I32, pos), d, mode, base,
                                   out_scale=out_scale, norm=lf.weight("w", F32, wd.shape, wd), eps=1e-6)
    return make


def _rope_set_rows(n: int, heads: int, mode: int, n_dims: int, d: int, base: float, fscale: float, dtype: DType,
                   n_ctx: int = 100, norm: bool = False):
    """Keys rotated straight into scattered cache rows; the whole cache (written and untouched rows) compared."""
    def make(rng):
        xd, pos = values(rng, n, heads, d, scale=3.0 if norm else 1.0), positions(rng, n)
        cd, wd = values(rng, n_ctx, heads * d).astype(dtype.np_dtype), values(rng, d)
        idx = rng.choice(n_ctx, size=n, replace=False).astype(np.int32)

        def build(lf):
            w = lf.weight("w", F32, wd.shape, wd) if norm else None
            return ops.rope_set_rows(lf.weight("cache", dtype, cd.shape, cd), lf.input("k", F32, xd),
                                     lf.input("idx", I32, idx), lf.input("pos", I32, pos), n_dims, mode, base, fscale,
                                     norm=w, eps=1e-6)
        return build
    return make


def _set_rows(dtype: DType, n_ctx: int, width: int, idx: list[int]):
    def make(rng):
        rows, cd = values(rng, len(idx), width), values(rng, n_ctx, width).astype(dtype.np_dtype)
        ix = np.array(idx, dtype=np.int32)
        return lambda lf: ops.set_rows(lf.weight("cache", dtype, cd.shape, cd), lf.input("rows", F32, rows),
                                       lf.input("idx", I32, ix))
    return make


def rope_cases() -> list[OpCase]:
    cases = [OpCase(f"rope-{mode}-{n_dims}of{d}-n{n}", _rope(n, 3, mode, n_dims, d, base, fscale), ROPE, CPU)
             for mode, n_dims, d, base, fscale in ROPES for n in (1, 2, 7, 33)]
    cases.append(OpCase("rope-prompt", _rope(512, 9, ROPE_NORMAL, 64, 64, 10000.0, 1.0, list(range(512))), ROPE, CPU))
    far = [0, 1, 5, 9, 100, 4000, 7]
    cases += [OpCase(f"rope-far-positions-{mode}-{'norm' if norm else 'plain'}",
                     _rope(7, 3, mode, 64, 64, 10000.0, 1.0, far, norm), ROPE, CUDA)
              for mode in (ROPE_NORMAL, ROPE_NEOX) for norm in (False, True)]
    cases += [OpCase(f"rope-fused-norm-and-scale-n{n}", _rope_fused_norm(n, ROPE_NEOX, 32, 1e6, 0.17), ROPE, CPU)
              for n in (1, 7)]
    cases += [OpCase(f"rope-freq-factors-{mode}-{'norm' if norm else 'plain'}{'-longrope' if lr else ''}-n{n}",
                     _rope_freq_factors(n, mode, norm, lr), ROPE)
              for mode, norm, lr in ((ROPE_NORMAL, False, False), (ROPE_NEOX, True, False), (ROPE_NEOX, False, True))
              for n in (1, 33)]
    cases += [OpCase(f"rope_set_rows-{t}-{mode}-{n_dims}of{d}-n{n}",
                     _rope_set_rows(n, 2, mode, n_dims, d, base, fscale, t), ROPE, CPU)
              for t in (F16, F32) for mode, n_dims, d, base, fscale in ROPES[:3] for n in (1, 2, 33)]
    cases += [OpCase(f"rope_set_rows-{t}-small-cache", _rope_set_rows(3, 2, ROPE_NEOX, 32, 32, 10000.0, 1.0, t, 10),
                     ROPE, CUDA) for t in (F16, F32)]
    cases.append(OpCase("rope_set_rows-fused-norm", _rope_set_rows(7, 1, ROPE_NEOX, 32, 32, 10000.0, 1.0, F16, 40,
                                                                     norm=True), ROPE, CPU))
    cases += [OpCase(f"set_rows-{t}-{n}", _set_rows(t, n_ctx, w, idx), ROPE, on)
              for t in (F16, F32) for n, (n_ctx, w, idx, on) in
              {"7-rows": (64, 96, [5, 0, 63, 8, 9, 1, 40], CPU), "3-rows": (10, 64, [5, 0, 9], CUDA)}.items()]
    return cases


# ---- attention -------------------------------------------------------------------------------

def sink_values(rng: np.random.Generator, heads: int) -> np.ndarray:
    """Attention sinks of `heads` heads (f32 [heads]) about as large as the scores, but the first far above
    them (its share outweighs every cell's) and the last far below (it takes no share)."""
    s = values(rng, heads, scale=2.0)
    s[0], s[-1] = 8.0, -40.0
    return s


def attention_graph(n: int, h: int, h_kv: int, d: int, n_kv: int, n_ctx: int, dtype: DType = F16, q_f16: bool = True,
                    mask: Callable[[], np.ndarray] | None = None, sinks: bool = False, per_token: bool = False,
                    shared: bool = False):
    """Fused attention over the first n_kv cells of an n_ctx cache viewed per KV head (grouped queries), with
    attention sinks (sink_values) when asked; per_token marks it as the graph builder marks a decode step
    of many sequences, one token each, and shared one whose sequences may share cells."""
    def make(rng):
        qd = values(rng, n, h, d)
        kd, vd = (values(rng, n_ctx, h_kv * d).astype(dtype.np_dtype) for _ in range(2))
        md = causal_mask(n, n_kv, n_kv) if mask is None else mask()
        sd = sink_values(rng, h) if sinks else None

        return lambda lf: cache_attention(lf, dtype, kd, vd, qd, md, sd, q_f16, per_token, shared)
    return make


def own_cells_mask(n: int, n_kv: int) -> np.ndarray:
    """f16 [n, n_kv]: token t of n sequences sees the first cells of block t of 64 cells (more for later
    tokens), as a decode step of many sequences in blocks of their own (core/llm/kv_blocks.py) does."""
    m = np.full((n, n_kv), -np.inf, dtype=np.float32)
    for t in range(n):
        m[t, 64 * t:64 * t + 20 + 13 * t] = 0
    return m.astype(np.float16)


def _seen_mask(t: int, n_kv: int, seen: int | None) -> Callable[[], np.ndarray]:
    """Causal over the first `seen` cells (all when None), the rest hidden: a padded cache."""
    def mask():
        top = n_kv if seen is None else seen
        cells = np.arange(n_kv)[None, :]
        hidden = (cells > (top - t + np.arange(t))[:, None]) | (cells >= top)
        return np.where(hidden, -np.inf, 0).astype(np.float16)
    return mask


def attention_case(kv_dtype: DType, t: int, n_kv: int, hq: int, hk: int, d: int, seen: int | None):
    """Fused attention with the queries given heads first [hq, t, d], over n_kv cached keys, causal, and
    only the first `seen` cells visible (the rest of a padded cache) when given."""
    def make(rng):
        qd = values(rng, hq, t, d)
        kd, vd = (values(rng, n_kv, hk * d).astype(kv_dtype.np_dtype) for _ in range(2))
        md = _seen_mask(t, n_kv, seen)()

        def build(lf):
            k = ops.permute(ops.view(lf.weight("k", kv_dtype, (n_kv, hk * d), kd), (n_kv, hk, d)), (1, 0, 2))
            v = ops.permute(ops.view(lf.weight("v", kv_dtype, (n_kv, hk * d), vd), (n_kv, hk, d)), (1, 0, 2))
            return ops.flash_attn(lf.input("q", F32, qd), k, v, lf.input("mask", F16, md), scale=d ** -0.5)
        return build
    return make


def attention_cases() -> list[OpCase]:
    cases = [OpCase(f"flash_attn-n{n}-h{h}-kv{h_kv}-d{d}-cells{n_kv}", attention_graph(n, h, h_kv, d, n_kv, n_kv + 11),
                    ATTENTION, CPU)
             for n, h, h_kv, d, n_kv in [(1, 9, 3, 64, 256), (2, 4, 2, 32, 77), (7, 8, 8, 16, 300), (33, 4, 1, 32, 513),
                                         (8, 6, 2, 64, 65)]]
    cases.append(OpCase("flash_attn-prompt", attention_graph(512, 9, 3, 64, 512, 512), ATTENTION, CPU))
    cases += [OpCase(f"flash_attn-f32-cache-{'q-f16' if q else 'q-f32'}", attention_graph(7, 4, 2, 32, 100, 100, F32, q),
                     ATTENTION, CPU) for q in (True, False)]
    cases.append(OpCase("flash_attn-decode-padded-cache",
                        attention_graph(1, 9, 3, 64, 256, 300, mask=lambda: causal_mask(1, 256, 37, rows=8)), ATTENTION,
                        CPU))
    cases.append(OpCase("flash_attn-sliding-window",
                        attention_graph(33, 4, 1, 32, 200, 200, mask=lambda: causal_mask(33, 200, 150, window=8)),
                        ATTENTION, CPU))
    seen = [(1, 33, 4, 2, 64, None), (1, 1000, 9, 3, 64, None), (7, 256, 4, 1, 256, None), (64, 300, 8, 2, 128, None),
            (3, 40, 2, 2, 16, None), (1, 4096, 32, 8, 64, 37), (2, 8192, 8, 8, 128, 3000), (8, 512, 16, 4, 64, 200),
            (130, 160, 16, 4, 64, None), (129, 200, 8, 2, 128, None), (1, 300, 4, 1, 256, None),
            (2, 700, 4, 2, 128, 650),
            # groups of 8 and 16 query heads a KV head (qwen3-30b-a3b: 32 over 4, d 128), one token or a few:
            # attn_decode_rows' blocks of 4 rows, over one key chunk and several
            (1, 140, 32, 4, 128, None), (1, 3000, 32, 4, 128, 2900), (1, 300, 16, 1, 64, None),
            (1, 500, 16, 1, 128, 450), (2, 200, 8, 2, 64, None), (4, 600, 8, 2, 128, None)]
    cases += [OpCase(f"flash_attn-{kv}-t{t}-cells{n_kv}-h{hq}-kv{hk}-d{d}-seen{s}",
                     attention_case(kv, t, n_kv, hq, hk, d, s), ATTENTION, CUDA)
              for kv in (F16, F32) for t, n_kv, hq, hk, d, s in seen]
    return cases + attention_sink_cases()


def attention_sink_cases() -> list[OpCase]:
    """Fused attention with sinks at gpt-oss's head size (64) and grouping (8 query heads a KV head; 4 for the
    few-rows decode kernels): decode over one and several key chunks, a few tokens, prompts (causal and within
    a sliding window), an f32 cache, a step of many sequences."""
    window = lambda: causal_mask(512, 512, 512, window=128)  # noqa: E731
    shapes = {"decode-r8-chunks": (1, 16, 2, 300, F16, None, False), "decode-r8": (1, 16, 2, 100, F16, None, False),
              "decode-r4-chunks": (1, 8, 2, 300, F16, None, False), "decode-r4": (1, 8, 2, 200, F16, None, False),
              "tokens-7": (7, 16, 2, 300, F16, None, False), "prompt": (512, 16, 2, 512, F16, None, False),
              "prompt-window": (512, 16, 2, 512, F16, window, False), "f32-cache": (64, 16, 2, 130, F32, None, False),
              "own-cells": (3, 8, 2, 192, F16, lambda: own_cells_mask(3, 192), True),
              "own-cells-r8": (3, 16, 2, 192, F16, lambda: own_cells_mask(3, 192), True),
              "decode-r16": (1, 16, 1, 150, F16, None, False), "decode-r16-chunks": (1, 16, 1, 700, F16, None, False)}
    return [OpCase(f"flash_attn-sinks-{name}", attention_graph(n, h, h_kv, 64, n_kv, n_kv + 11, dtype, dtype is F16,
                                                              mask, sinks=True, per_token=per_token), ATTENTION)
            for name, (n, h, h_kv, n_kv, dtype, mask, per_token) in shapes.items()] + own_cells_cases()


def shared_prefix_mask(n: int, n_kv: int, prefix: int) -> np.ndarray:
    """f16 [n, n_kv]: n tokens of a decode step of many sequences that share the first `prefix` cells (a system
    prompt), each then over its own block of 64 cells after them, but for the last two: one sequence that shares
    nothing (its own block alone) and a padding row (cell 0 alone)."""
    m = np.full((n, n_kv), -np.inf, dtype=np.float32)
    own = -(-prefix // 64) * 64
    for t in range(n - 2):
        m[t, :prefix] = 0
        m[t, own + 64 * t:own + 64 * t + 5 + 3 * t] = 0
    m[n - 2, own + 64 * (n - 2):own + 64 * (n - 2) + 40] = 0
    m[n - 1, 0] = 0
    return m.astype(np.float16)


def own_cells_cases() -> list[OpCase]:
    """Decode steps of many sequences (per_token: attn_tiles, then attn_decode_tok) without sinks: groups of 4, 8
    and 16 query heads a KV head at head sizes 64 and 128, tokens each over their own block of cells; then steps
    whose sequences share a prefix of cells, read once for all where it has 8 tiles of 32 or more (flash_attn_tc's
    PREFIX pass in 4 key chunks, merged into each token's own part), and with 6 (each token reads them), rows of 64
    and more."""
    shapes = [(5, 8, 2, 64, 320), (4, 32, 4, 128, 256), (3, 16, 1, 64, 200), (6, 16, 1, 128, 384)]
    cases = [OpCase(f"flash_attn-own-cells-n{n}-h{h}-kv{h_kv}-d{d}",
                    attention_graph(n, h, h_kv, d, n_kv, n_kv + 11, mask=lambda n=n, n_kv=n_kv: own_cells_mask(n, n_kv),
                                    per_token=True), ATTENTION)
             for n, h, h_kv, d, n_kv in shapes]
    shared = [(20, 32, 8, 64, 3072, 1030), (12, 16, 4, 128, 2048, 700), (6, 16, 1, 64, 1024, 300),
              (9, 16, 2, 128, 1024, 260), (7, 8, 2, 64, 1024, 200)]
    return cases + [OpCase(f"flash_attn-shared-prefix{p}-n{n}-h{h}-kv{h_kv}-d{d}",
                           attention_graph(n, h, h_kv, d, n_kv, n_kv + 11, per_token=True, shared=True,
                                           mask=lambda n=n, n_kv=n_kv, p=p: shared_prefix_mask(n, n_kv, p)), ATTENTION)
                    for n, h, h_kv, d, n_kv, p in shared]


# ---- element-wise, softmax and data movement --------------------------------------------------

def _gated(op: str, n: int, width: int, scale: float, f16_table: bool | None = None, table_ends: bool = False):
    def make(rng):
        gd, ud = values(rng, n, width, scale=scale), values(rng, n, width)
        if table_ends:
            gd[0, :8] = [-12, -10, -9.99, 0, 9.99, 10, 11, 65504]  # both ends of ggml's table
        kw = {} if f16_table is None else {"f16_table": f16_table}
        return lambda lf: getattr(ops, op)(lf.input("g", F32, gd), lf.input("u", F32, ud), **kw)
    return make


def _unary(op: Callable, shape: tuple[int, ...], scale: float):
    def make(rng):
        xd = values(rng, *shape, scale=scale)
        return lambda lf: op(lf.input("x", F32, xd))
    return make


def _binary(op: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]):
    def make(rng):
        ad, bd = values(rng, *a_shape), values(rng, *b_shape)
        return lambda lf: getattr(ops, op)(lf.input("a", F32, ad), lf.input("b", F32, bd))
    return make


def _soft_max(heads: int, n: int, n_kv: int, mask: bool, scale: float, used: int | None = None):
    """The non-fused attention's softmax: kq [heads, tokens, n_kv] * scale + mask (f16, more rows than
    tokens, a padded tail) over the last axis."""
    def make(rng):
        xd = values(rng, heads, n, n_kv, scale=4.0)
        md = causal_mask(n, n_kv, used or n_kv, rows=n + 5)
        m = (lambda lf: lf.input("mask", F16, md)) if mask else (lambda lf: None)
        return lambda lf: ops.soft_max(lf.input("kq", F32, xd), m(lf), scale)
    return make


def _soft_max_masked_tail(rng):
    """Scores of 7 rows over 40 cells, the last few of each row masked."""
    ad = values(rng, 4, 7, 40)
    md = np.where(np.arange(40)[None, :] > np.arange(7)[:, None] + 30, -np.inf, 0).astype(np.float16)
    return lambda lf: ops.soft_max(lf.input("a", F32, ad), lf.input("m", F16, md), scale=0.3)


def _get_rows_of_an_intermediate(rng):
    """The output rows of the last layer: rows of a computed stream."""
    xd, ids = values(rng, 7, 64), np.array([6, 2], dtype=np.int32)
    return lambda lf: ops.get_rows(ops.scale(lf.input("x", F32, xd), 1.0), lf.input("ids", I32, ids))


def _get_rows_table(dtype: DType, n: int):
    def make(rng):
        table = values(rng, 50, 576).astype(dtype.np_dtype)
        ids = rng.integers(0, 50, size=n).astype(np.int32)
        return lambda lf: ops.get_rows(lf.weight("t", dtype, table.shape, table), lf.input("ids", I32, ids))
    return make


def _cont_of_permuted_heads(dtype: DType, shape: tuple[int, int, int]):
    """kqv [heads, tokens, d] merged to [tokens, heads, d] (the non-fused attention's cont)."""
    def make(rng):
        xd = values(rng, *shape).astype(dtype.np_dtype)
        return lambda lf: ops.cont(ops.permute(lf.input("x", dtype, xd), (1, 0, 2)))
    return make


def _cast_there_and_back(rng):
    ad = values(rng, 5, 3, 8)
    return lambda lf: ops.cast(ops.cast(lf.input("a", F32, ad), F16), F32)


def _concat(axis: int):
    """The gather of a product split by rows, and concat along other axes."""
    def make(rng):
        shape = [5, 3, 8]
        ad = values(rng, *shape)
        shape[axis] += 2
        bd = values(rng, *shape)
        return lambda lf: ops.concat(lf.input("a", F32, ad), lf.input("b", F32, bd), axis)
    return make


def elementwise_cases() -> list[OpCase]:
    cases = [OpCase(f"swiglu-n{n}", _gated("swiglu", n, 1536, 4.0), GATED, CPU) for n in (1, 2, 7, 33, 512)]
    cases += [OpCase(f"geglu-{'table' if t else 'exact'}-n{n}", _gated("geglu", n, 2048, 5.0, t, table_ends=True),
                     GATED, CPU) for t in (True, False) for n in (1, 7, 33)]
    cases += [OpCase(f"{op}-odd-width", _gated(op, 9, 130, 1.0), GATED, CUDA) for op in ("swiglu", "geglu")]
    cases.append(OpCase("gelu-table", _unary(lambda x: ops.gelu(x, f16_table=True), (7, 333), 6.0), ELEMENTWISE, CPU))
    cases += [OpCase(f"silu-{'x'.join(map(str, s))}", _unary(ops.silu, s, scale), ELEMENTWISE, on)
              for s, scale, on in (((7, 333), 6.0, CPU), ((5, 3, 8), 1.0, CUDA))]
    cases += [OpCase(f"scale-{'x'.join(map(str, s))}", _unary(lambda x, by=by: ops.scale(x, by), s, 1.0), ELEMENTWISE, on)
              for s, by, on in (((3, 640), 25.3, CPU), ((5, 3, 8), 0.5, CUDA))]
    cases += [OpCase(f"{op}-{'x'.join(map(str, a))}-{'x'.join(map(str, b))}", _binary(op, a, b), ELEMENTWISE, on)
              for op in ("add", "mul") for a, bs, on in (((7, 33), ((7, 33), (33,), (1, 33), (1,)), CPU),
                                                         ((7, 64), ((7, 64), (64,), (1, 64)), CUDA)) for b in bs]
    cases += [OpCase(f"soft_max-masked-n{n}-cells{n_kv}-h{h}", _soft_max(h, n, n_kv, True, 0.125, n_kv - 3), ELEMENTWISE,
                     CPU) for n, n_kv, h in [(1, 256, 9), (7, 77, 4), (33, 300, 2)]]
    cases.append(OpCase("soft_max-no-mask", _soft_max(3, 5, 77, False, 0.7), ELEMENTWISE, CPU))
    cases.append(OpCase("soft_max-masked-tail", _soft_max_masked_tail, ELEMENTWISE, CUDA))
    cases += [OpCase(f"get_rows-table-{t}-n{n}", _get_rows_table(t, n), ELEMENTWISE, CPU)
              for t in (F32, F16) for n in (1, 2, 33)]
    cases.append(OpCase("get_rows-of-an-intermediate", _get_rows_of_an_intermediate, ELEMENTWISE, CPU))
    cases += [OpCase(f"cont-permuted-heads-{t}", _cont_of_permuted_heads(t, (9, 7, 64)), EXACT, CPU) for t in (F32, F16)]
    cases.append(OpCase("cont-permuted-small", _cont_of_permuted_heads(F32, (5, 3, 8)), EXACT, CUDA))
    cases.append(OpCase("cast-f16-and-back", _cast_there_and_back, EXACT, CUDA))
    cases += [OpCase(f"concat-axis{a}", _concat(a), EXACT, CUDA) for a in (-1, 0, 1)]
    return cases


# ---- mixtures of experts and gpt-oss (qwen3moe, gpt-oss) -------------------------------------------

def _expert_ids(rng, n: int, n_expert: int, k: int) -> np.ndarray:
    """i32 [n, k]: k distinct experts a token, as moe_topk chooses them."""
    return np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(n)]).astype(np.int32)


def _experts_weight(lf: Leafs, name: str, dtype: DType, shape: tuple[int, int, int], data: np.ndarray):
    """Expert matrices as a model loads them under llama numerics: a block type's activations rounded to the 8-bit
    blocks of its ggml vec_dot (`act_quant`), which the CPU's compiled experts kernels require."""
    w = lf.weight(name, dtype, shape, data)
    if dtype.is_quantized:
        w.params["act_quant"] = vec_dot_blocks(dtype.name)
    return w


def _mul_mat_id(dtype: DType, n: int, n_expert: int, k: int, per_slot: bool, m: int = 80):
    """The experts' products of n tokens, k experts each: one activation row a token (gate, up) or a slot
    (down)."""
    def make(rng):
        cols = 512 if dtype.block_size == 256 else 96
        data = weight_data(dtype, n_expert * m, cols, seed=int(rng.integers(1 << 30)))
        x, ids = values(rng, n, k if per_slot else 1, cols), _expert_ids(rng, n, n_expert, k)
        return lambda lf: ops.mul_mat_id(_experts_weight(lf, "w", dtype, (n_expert, m, cols), data),
                                         lf.input("x", F32, x), lf.input("ids", I32, ids))
    return make


def _mul_mat_id_skewed(dtype: DType, n: int, n_expert: int, k: int):
    """Every token routed to expert 0 beside k - 1 others: expert 0 holds several times the average slots, so
    the prompt kernel's blocks of that expert loop over more tiles of slots than its grid gives them."""
    def make(rng):
        m, cols = 48, 512 if dtype.block_size == 256 else 128
        data = weight_data(dtype, n_expert * m, cols, seed=int(rng.integers(1 << 30)))
        others = np.stack([rng.choice(np.arange(1, n_expert), size=k - 1, replace=False) for _ in range(n)])
        ids = np.concatenate([np.zeros((n, 1), dtype=np.int32), others.astype(np.int32)], axis=1)
        x = values(rng, n, 1, cols)
        return lambda lf: ops.mul_mat_id(_experts_weight(lf, "w", dtype, (n_expert, m, cols), data),
                                         lf.input("x", F32, x), lf.input("ids", I32, ids))
    return make


def _gated_experts(dtype: DType, n: int, glu: str):
    """A gated unit over the experts' gate and up products (qwen3moe's feed-forward's first half)."""
    def make(rng):
        m, cols, n_expert, k = 64, 256, 8, 3
        gd, ud = (weight_data(dtype, n_expert * m, cols, seed=int(rng.integers(1 << 30))) for _ in range(2))
        x, ids = values(rng, n, 1, cols), _expert_ids(rng, n, n_expert, k)

        def build(lf):
            xs, ix = lf.input("x", F32, x), lf.input("ids", I32, ids)
            gate = ops.mul_mat_id(lf.weight("gate", dtype, (n_expert, m, cols), gd), xs, ix)
            up = ops.mul_mat_id(lf.weight("up", dtype, (n_expert, m, cols), ud), xs, ix)
            return getattr(ops, glu)(gate, up)
        return build
    return make


def _weighted_sum(n: int, k: int, width: int):
    """The experts' outputs weighted and summed (blocks.weighted_sum: a mul and k - 1 adds)."""
    def make(rng):
        ed, wd = values(rng, n, k, width), np.abs(values(rng, n, k))
        return lambda lf: weighted_sum(lf.input("e", F32, ed), lf.input("w", F32, wd), 0)
    return make


def _moe_routing(op: str, n: int, n_expert: int, k: int, norm: bool = False):
    """A router's choice (moe_topk) or its weights (moe_weights) over softmax probabilities, some tied."""
    def make(rng):
        logits = values(rng, n, n_expert, scale=2.0)
        logits[0, 3] = logits[0, 5] = logits[0].max() + 1  # a tie at the top: the lower index first
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)
        ids = _expert_ids(rng, n, n_expert, k)

        def build(lf):
            p = lf.input("p", F32, probs)
            if op == "moe_topk":
                return ops.moe_topk(p, k)
            return ops.moe_weights(p, lf.input("ids", I32, ids), norm)
        return build
    return make


def _swiglu_oai(n: int, width: int, scale: float):
    """gpt-oss's gated unit, gate and up beyond its clamp (7) both ways."""
    def make(rng):
        gd, ud = values(rng, n, width, scale=scale), values(rng, n, width, scale=scale)
        return lambda lf: ops.swiglu_oai(lf.input("g", F32, gd), lf.input("u", F32, ud), 1.702, 7.0)
    return make


def _soft_max_sinks(heads: int, n: int, n_kv: int):
    """gpt-oss's attention softmax: masked scores and a sink logit per head."""
    def make(rng):
        xd, sd = values(rng, heads, n, n_kv, scale=4.0), values(rng, heads, scale=3.0)
        md = causal_mask(n, n_kv, n_kv - 3, rows=n + 5, window=5)
        return lambda lf: ops.soft_max(lf.input("kq", F32, xd), lf.input("mask", F16, md), 0.125,
                                       sinks=lf.weight("sinks", F32, sd.shape, sd))
    return make


def _rope_yarn(n: int, ext_factor: float, fscale: float):
    """gpt-oss's RoPE: neox pairs, YaRN's ramp (ext_factor) between the interpolated and original angles."""
    def make(rng):
        xd, p = values(rng, n, 3, 64, scale=2.0), positions(rng, n)
        yarn = ops.Yarn(ext_factor, 1.2, 32.0, 1.0, 4096)
        return lambda lf: ops.rope(lf.input("x", F32, xd), lf.input("pos", I32, p), 64, ROPE_NEOX, 150000.0, fscale,
                                   yarn=yarn)
    return make


def _expert_bias(dtype: DType, n: int, per_slot: bool, n_expert: int = 8, k: int = 3, m: int = 80):
    """The experts' products plus their rows of a bias matrix (blocks.expert_product: get_rows, then add)."""
    def make(rng):
        cols = 512 if dtype.block_size == 256 else 96
        data = weight_data(dtype, n_expert * m, cols, seed=int(rng.integers(1 << 30)))
        x, ids = values(rng, n, k if per_slot else 1, cols), _expert_ids(rng, n, n_expert, k)
        bd = values(rng, n_expert, m, scale=2.0)
        return lambda lf: expert_product(lf.weight("w", dtype, (n_expert, m, cols), data),
                                         lf.weight("b", F32, bd.shape, bd), lf.input("x", F32, x),
                                         lf.input("ids", I32, ids), "experts")
    return make


def _gated_experts_bias(dtype: DType, n: int, glu: str):
    """gpt-oss's experts' first half: gate and up products each plus their bias rows, then the gated unit (swiglu_oai,
    gate and up beyond its clamp of 7 both ways; or swiglu)."""
    def make(rng):
        m, cols, n_expert, k = 64, 256, 8, 4
        gd, ud = (weight_data(dtype, n_expert * m, cols, seed=int(rng.integers(1 << 30))) for _ in range(2))
        x, ids = values(rng, n, 1, cols), _expert_ids(rng, n, n_expert, k)
        gb, ub = values(rng, n_expert, m, scale=4.0), values(rng, n_expert, m, scale=4.0)

        def build(lf):
            xs, ix = lf.input("x", F32, x), lf.input("ids", I32, ids)
            gate = expert_product(lf.weight("gate", dtype, (n_expert, m, cols), gd), lf.weight("gb", F32, gb.shape, gb),
                                  xs, ix, "gate")
            up = expert_product(lf.weight("up", dtype, (n_expert, m, cols), ud), lf.weight("ub", F32, ub.shape, ub),
                                xs, ix, "up")
            if glu == "swiglu_oai":
                return ops.swiglu_oai(gate, up, 1.702, 7.0)
            return ops.swiglu(gate, up)
        return build
    return make


def _rope_bias(n: int, heads: int, d: int, n_dims: int, mode: int, yarn: bool, into: str):
    """Attention's q or k with a bias (gpt-oss, qwen2): rows [n, heads * d] plus a bias vector, then the heads' RoPE
    (YaRN's with `yarn`) into a result (`into` "rope"), into cache rows ("rope_set_rows"), or the rows written to the
    cache unrotated ("set_rows": v)."""
    def make(rng):
        xd, bd, p = values(rng, n, heads * d), values(rng, heads * d, scale=2.0), positions(rng, n)
        cd = values(rng, 40, heads * d).astype(np.float16)
        idx = rng.choice(40, size=n, replace=False).astype(np.int32)
        ya = ops.Yarn(1.0, 1.2, 32.0, 1.0, 4096) if yarn else None

        def build(lf):
            biased = ops.add(lf.input("x", F32, xd), lf.weight("b", F32, bd.shape, bd))
            if into == "set_rows":
                return ops.set_rows(lf.weight("cache", F16, cd.shape, cd), biased, lf.input("idx", I32, idx))
            heads_of = ops.reshape(biased, (n, heads, d))
            pos = lf.input("pos", I32, p)
            if into == "rope_set_rows":
                return ops.rope_set_rows(lf.weight("cache", F16, cd.shape, cd), heads_of, lf.input("idx", I32, idx),
                                         pos, n_dims, mode, 10000.0, 1.0)
            return ops.rope(heads_of, pos, n_dims, mode, 150000.0, 1 / 32 if yarn else 1.0, yarn=ya)
        return build
    return make


def moe_cases() -> list[OpCase]:
    cases = [OpCase(f"mul_mat_id-{t}-n{n}-{'slots' if per_slot else 'tokens'}",
                    _mul_mat_id(t, n, 16, 4, per_slot), MUL_MAT, CUDA if t is F16 else BOTH)
             for t in (DType.Q4_K, DType.MXFP4, DType.Q8_0, F16) for n in (1, 3, 9, 70) for per_slot in (False, True)]
    cases.append(OpCase("mul_mat_id-many-slots-one-expert", _mul_mat_id(DType.Q4_0, 150, 2, 2, False, m=130), MUL_MAT,
                        BOTH))
    cases += [OpCase(f"mul_mat_id-skewed-{t}-n{n}", _mul_mat_id_skewed(t, n, 16, 4), MUL_MAT, BOTH)
              for t in (DType.Q4_K, DType.IQ4_NL) for n in (70, 200)]
    cases += [OpCase(f"mul_mat_id-gated-{glu}-{t}-n{n}", _gated_experts(t, n, glu), GLU, CUDA,
                     fused="mmvq_id_glu" if n <= 8 else "mmq_idt_pair")
              for glu in ("swiglu", "geglu") for t in (DType.Q4_K, DType.MXFP4) for n in (1, 2, 9, 40)]
    cases += [OpCase(f"moe-weighted-sum-k{k}-n{n}", _weighted_sum(n, k, 96), ELEMENTWISE, CUDA)
              for k in (1, 2, 4, 8) for n in (1, 7)]
    cases += [OpCase(f"moe_topk-{e}-k{k}-n{n}", _moe_routing("moe_topk", n, e, k), EXACT, BOTH)
              for e, k in ((128, 8), (32, 4), (60, 1)) for n in (1, 33)]
    cases += [OpCase(f"moe_weights-{'norm' if norm else 'plain'}-n{n}", _moe_routing("moe_weights", n, 128, 8, norm),
                     ELEMENTWISE, BOTH) for norm in (False, True) for n in (1, 33)]
    cases += [OpCase(f"swiglu_oai-n{n}", _swiglu_oai(n, 2880, 6.0), GATED, BOTH) for n in (1, 33)]
    cases += [OpCase(f"soft_max-sinks-n{n}", _soft_max_sinks(8, n, 77), ELEMENTWISE, BOTH) for n in (1, 7)]
    cases += [OpCase(f"rope-yarn-ext{e}-n{n}", _rope_yarn(n, e, 1 / 32), ROPE, BOTH)
              for e in (1.0, 0.0) for n in (1, 9)]
    cases += [OpCase(f"mul_mat_id-bias-{t}-n{n}-{'slots' if per_slot else 'tokens'}", _expert_bias(t, n, per_slot),
                     MUL_MAT, CUDA, fused="mmvq_id+bias")
              for t in (DType.MXFP4, DType.Q4_K) for n in (1, 2, 3, 5, 8) for per_slot in (True, False)]
    cases += [OpCase(f"mul_mat_id-bias-{t}-n{n}-beyond-decode", _expert_bias(t, n, True), MUL_MAT, CUDA)
              for t in (DType.MXFP4, DType.Q4_K) for n in (9, 40)]
    cases += [OpCase(f"mul_mat_id-gated-bias-{glu}-{t}-n{n}", _gated_experts_bias(t, n, glu),
                     GLU_OAI_Q4_K if (glu, t) == ("swiglu_oai", DType.Q4_K) else GLU, CUDA,
                     fused="mmvq_id_glu+bias" if n <= 8 else "")
              for glu in ("swiglu_oai", "swiglu") for t in (DType.MXFP4, DType.Q4_K) for n in (1, 2, 3, 5, 8, 9)]
    cases += [OpCase(f"bias-{into}-{'yarn' if yarn else mode}-n{n}", _rope_bias(n, 4, 64, 64, mode, yarn, into), ROPE,
                     CUDA, fused=f"{into}+bias")
              for into, mode, yarn in (("rope", ROPE_NEOX, True), ("rope", ROPE_NORMAL, False),
                                       ("rope_set_rows", ROPE_NEOX, False), ("set_rows", ROPE_NEOX, False))
              for n in (1, 3)]
    return cases


CASES: list[OpCase] = (product_cases() + norm_cases() + rope_cases() + attention_cases() + elementwise_cases()
                       + moe_cases())
