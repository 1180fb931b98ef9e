"""The op-by-op harness (in the spirit of llama.cpp's test-backend-ops): build one small graph
twice, run it on a backend under test and on the reference host backend (the numpy array
kernels), and compare the results by normalized mean squared error, as ggml does.

`build(ctx)` makes its leafs through the given `Leafs` (weights in an immediate context on the
backend, inputs fed after planning) and returns the output tensor; it is called once per
backend with the same random data. `weight_data` makes a weight's stored bytes for every type.
For the op tests (tests/core/) and the kernel benchmarks (scripts/bench/); the engine never calls it.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

from ggrun.core import ops
from ggrun.core.backends.base import Backend
from ggrun.core.backends.host import HostArrayBackend
from ggrun.core.backends.kernels import narrow_into
from ggrun.core.context import ImmediateContext
from ggrun.core.dtypes import DType
from ggrun.core.graph import build_graph
from ggrun.core.sched import Scheduler
from ggrun.core.tensor import Tensor, new_tensor

LEGACY = [DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0]
K_QUANTS = [DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K]
LUT4 = [DType.IQ4_NL, DType.IQ4_XS, DType.MXFP4]  # lut4.py's kernels
PLAIN = [DType.F16, DType.BF16, DType.F32]
TYPES = LEGACY + K_QUANTS + LUT4 + PLAIN

# Byte offsets of each k-quant's f16 super-block scale and f16 min scale (ggml-common.h).
_K_SCALES = {DType.Q2_K: (80, 82), DType.Q3_K: (108, None), DType.Q4_K: (0, 2), DType.Q5_K: (0, 2),
             DType.Q6_K: (208, None), DType.IQ4_NL: (0, None), DType.IQ4_XS: (0, None)}


def weight_data(dtype: DType, m: int, k: int, seed: int) -> np.ndarray:
    """A weight's stored form: gguf's quantization of random values (legacy types), valid random
    blocks of k-quants and lut4 types (gguf cannot quantize those), or the values of a plain type."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((m, k)).astype(np.float32)
    if dtype is DType.F32:
        return values
    if dtype is DType.F16:
        return values.astype(np.float16)
    if dtype is DType.BF16:
        bits = np.empty(values.shape, np.uint16)
        narrow_into(np, bits, values, DType.BF16)
        return bits
    if dtype in LEGACY:
        return np.asarray(gguf_quantize(values, QT[dtype.name])).view(np.uint8).reshape(m, -1)
    n_blocks = m * k // dtype.block_size
    blocks = rng.integers(0, 256, size=(n_blocks, dtype.type_size), dtype=np.uint8)
    if dtype is DType.MXFP4:  # the E8M0 exponent byte: scales of 2^-9 .. 2^-1
        blocks[:, 0] = rng.integers(118, 127, n_blocks)
        return blocks.reshape(m, -1)
    d_at, dmin_at = _K_SCALES[dtype]
    blocks[:, d_at:d_at + 2] = rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if dmin_at is not None:
        blocks[:, dmin_at:dmin_at + 2] = rng.uniform(0, 0.05, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(m, -1)


class ReferenceBackend(HostArrayBackend):
    """The numpy array kernels alone, on host memory: the oracle."""

    name = "REF"

    def __init__(self) -> None:
        self.device = "reference numpy kernels"


class Leafs:
    """Makes a graph's leafs on one backend: weights from raw stored bytes or values, inputs fed later."""

    def __init__(self, backend: Backend) -> None:
        self.ctx = ImmediateContext(backend)
        self.feeds: dict[Tensor, np.ndarray] = {}

    def weight(self, name: str, dtype: DType, shape: tuple[int, ...], data: np.ndarray) -> Tensor:
        """A weight of dtype stored as `data` (bytes for a block-quantized type, values otherwise)."""
        if dtype.is_quantized:
            return self.ctx.from_bytes(name, dtype, shape, np.ascontiguousarray(data, dtype=np.uint8).reshape(-1))
        t = self.ctx.new_tensor(name, dtype, shape, weight=True)
        self.ctx.backend.set_tensor(t, data)
        return t

    def input(self, name: str, dtype: DType, data: np.ndarray) -> Tensor:
        t = new_tensor(name, dtype, data.shape, is_input=True)
        self.feeds[t] = data
        return t


def cache_attention(lf: Leafs, dtype: DType, kd: np.ndarray, vd: np.ndarray, qd: np.ndarray, mask: np.ndarray,
                    sinks: np.ndarray | None = None, q_f16: bool = False, per_token: bool = False,
                    shared: bool = False) -> Tensor:
    """One fused attention (ops.flash_attn) of queries qd (f32 [n, heads, d]) over the first mask.shape[1] cells of a
    cache's keys and values kd, vd ([cells, KV heads * d] of float type dtype), viewed per KV head, under the f16
    mask [n, cells]; with sinks (f32 [heads]) where given. q_f16: the queries meet the cache rounded to f16 (llama
    numerics); per_token: marked as the graph builder marks a decode step of many sequences, one token each; shared:
    one whose sequences may share cells too (GraphParams.shared)."""
    n_kv, d = mask.shape[1], qd.shape[2]
    h_kv, e = kd.shape[1] // d, dtype.itemsize
    k, v = lf.weight("k", dtype, kd.shape, kd), lf.weight("v", dtype, vd.shape, vd)
    if q_f16:
        k.params["act_quant"] = v.params["act_quant"] = "f16"
    view = ((n_kv, h_kv, d), (h_kv * d * e, d * e, e))
    keys, vals = (ops.permute(ops.view(c, *view), (1, 0, 2)) for c in (k, v))
    q = ops.permute(lf.input("q", DType.F32, qd), (1, 0, 2))
    s = None if sinks is None else lf.weight("sinks", DType.F32, sinks.shape, sinks)
    out = ops.flash_attn(q, keys, vals, lf.input("mask", DType.F16, mask), d ** -0.5, sinks=s)
    if per_token:
        out.params["per_token"] = True
    if shared:
        out.params["shared_prefix"] = True
    return out


def planned(backend: Backend, build: Callable[[Leafs], Tensor]):
    """Build, schedule and plan the graph on one backend: (scheduler, scheduled graph, leafs, output)."""
    leafs = Leafs(backend)
    out = build(leafs)
    sched = Scheduler([backend])
    sg = sched.schedule(build_graph([out]))
    sched.alloc(sg)
    return sched, sg, leafs, out


def run_on(backend: Backend, build: Callable[[Leafs], Tensor]) -> np.ndarray:
    """Build, schedule, plan and compute the graph on one backend; a host copy of its output."""
    sched, sg, leafs, out = planned(backend, build)
    for t, data in leafs.feeds.items():
        sched.set_tensor(t, data)
    sched.compute(sg)
    return sched.get_tensor(out).astype(np.float64)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """ggml's normalized mean squared error: sum((got - want)^2) / sum(want^2)."""
    want = np.asarray(want, dtype=np.float64)
    err = np.sum((np.asarray(got, dtype=np.float64) - want) ** 2)
    norm = np.sum(want ** 2)
    return float(err / norm) if norm > 0 else float(err)


def compare(backend: Backend, build: Callable[[Leafs], Tensor]) -> float:
    """NMSE of `backend`'s result against the reference kernels' result for the same graph."""
    got = run_on(backend, build)
    want = run_on(ReferenceBackend(), build)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    return nmse(got, want)
