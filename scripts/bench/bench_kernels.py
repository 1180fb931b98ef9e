#!/usr/bin/env python3
"""Compiled CPU kernels against the numpy reference kernels, op by op, on SmolLM2-135M's shapes
(n_embd 576, 9 heads over 3 KV heads, head_dim 64, n_ff 1536, 30 layers, Q4_1 weights repacked
as at load): one node per graph, each prepared once and replayed as a reused graph does; medians
in microseconds and the ratio, for a decode step (1 token) and a prompt micro-batch (512
tokens), the weight products' rate in 8-bit multiply-adds per second, and the total over a
layer's nodes times 30.

    .venv/bin/python scripts/bench/bench_kernels.py            # -t 1
    .venv/bin/python scripts/bench/bench_kernels.py -t 2 --reps 50
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, set_threads
from ggrun.core.backends.op_harness import Leafs, ReferenceBackend, weight_data
from ggrun.core.dtypes import DType
from ggrun.core.graph import build_graph
from ggrun.core.sched import Scheduler

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_LAYER = 576, 9, 3, 64, 1536, 30
N_CTX = 1024
rng = np.random.default_rng(0)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def cache(lf, name):
    t = lf.weight(name, DType.F16, (N_CTX, N_HEAD_KV * HEAD_DIM),
                  rng.standard_normal((N_CTX, N_HEAD_KV * HEAD_DIM)).astype(np.float16))
    t.params["act_quant"] = "f16"
    return t


def causal_mask(n, n_kv, used):
    m = np.full((n, n_kv), -np.inf, dtype=np.float32)
    for t in range(n):
        m[t, :used - n + t + 1] = 0
    return m.astype(np.float16)


def kv_views(lf, k, v, n_kv):
    view = ((n_kv, N_HEAD_KV, HEAD_DIM), (N_HEAD_KV * HEAD_DIM * 2, HEAD_DIM * 2, 2))
    return ops.permute(ops.view(k, *view), (1, 0, 2)), ops.permute(ops.view(v, *view), (1, 0, 2))


WEIGHT_TYPE = DType.Q4_1
WEIGHTS = {name: (rows, cols, weight_data(WEIGHT_TYPE, rows, cols, seed)) for seed, (name, rows, cols) in enumerate(
    (("q", N_HEAD * HEAD_DIM, N_EMBD), ("k", N_HEAD_KV * HEAD_DIM, N_EMBD), ("v", N_HEAD_KV * HEAD_DIM, N_EMBD),
     ("o", N_EMBD, N_HEAD * HEAD_DIM), ("gate", N_FF, N_EMBD), ("up", N_FF, N_EMBD), ("down", N_EMBD, N_FF)))}


def weight(lf, name):
    """A layer weight as the model loader leaves it: stored blocks, 8-bit activations, repacked."""
    rows, cols, data = WEIGHTS[name]
    w = lf.weight(name, WEIGHT_TYPE, (rows, cols), data)
    w.params["act_quant"] = "q8_0"
    lf.ctx.prepare_weight(w)
    return w


def products(n: int) -> dict:
    """name -> (graph builder, multiply-adds) of a layer's weight products for n tokens."""
    def of(*names):
        def build(lf):
            x = lf.input("x", DType.F32, f32(n, WEIGHTS[names[0]][1]))
            ws = tuple(weight(lf, name) for name in names)
            if len(ws) == 1:
                return ops.mul_mat(ws[0], x)
            return ops.mul_mat_multi(ws, x, names)[0].view_src
        return build, n * sum(WEIGHTS[name][0] * WEIGHTS[name][1] for name in names)
    return {"q/k/v (multi)": of("q", "k", "v"), "attn out": of("o"), "gate/up (multi)": of("gate", "up"),
            "ffn down": of("down")}


def cases(n: int, n_kv: int, used: int) -> dict:
    """name -> graph builder, for n tokens attending n_kv cells of which `used` hold data."""
    pos = np.arange(used - n, used, dtype=np.int32)
    idx = pos.copy()

    def norm(lf):
        return ops.rms_norm_mul(lf.input("x", DType.F32, f32(n, N_EMBD)), lf.weight("w", DType.F32, (N_EMBD,), f32(N_EMBD)), 1e-5)

    def add_norm(lf):
        x, h = lf.input("x", DType.F32, f32(n, N_EMBD)), lf.input("h", DType.F32, f32(n, N_EMBD))
        return ops.add_rms_norm(x, h, lf.weight("w", DType.F32, (N_EMBD,), f32(N_EMBD)), 1e-5)

    def rope_q(lf):
        return ops.rope(lf.input("q", DType.F32, f32(n, N_HEAD, HEAD_DIM)), lf.input("pos", DType.I32, pos), HEAD_DIM)

    def rope_k(lf):
        return ops.rope_set_rows(cache(lf, "k"), lf.input("k", DType.F32, f32(n, N_HEAD_KV, HEAD_DIM)),
                                 lf.input("idx", DType.I32, idx), lf.input("pos", DType.I32, pos), HEAD_DIM)

    def store_v(lf):
        return ops.set_rows(cache(lf, "v"), lf.input("v", DType.F32, f32(n, N_HEAD_KV * HEAD_DIM)), lf.input("idx", DType.I32, idx))

    def fattn(lf):
        keys, vals = kv_views(lf, cache(lf, "k"), cache(lf, "v"), n_kv)
        q = ops.permute(lf.input("q", DType.F32, f32(n, N_HEAD, HEAD_DIM)), (1, 0, 2))
        return ops.flash_attn(q, keys, vals, lf.input("mask", DType.F16, causal_mask(n, n_kv, used)), HEAD_DIM ** -0.5)

    def swiglu(lf):
        return ops.swiglu(lf.input("g", DType.F32, f32(n, N_FF)), lf.input("u", DType.F32, f32(n, N_FF)))

    return {"add_rms_norm": add_norm, "rms_norm_mul": norm, "rope (q)": rope_q, "rope_set_rows (k)": rope_k,
            "set_rows (v)": store_v, "flash_attn": fattn, "swiglu": swiglu}


def prepared(backend, build):
    """The prepared call of the graph's last node, its other nodes run once."""
    lf = Leafs(backend)
    out = build(lf)
    sched = Scheduler([backend])
    sg = sched.schedule(build_graph([out]))
    sched.alloc(sg)
    for t, data in lf.feeds.items():
        sched.set_tensor(t, data)
    sched.compute(sg)
    call = sg.splits[-1].calls[-1]
    if isinstance(call, tuple):  # the array backends' prepared form: (kernel, node, out, srcs)
        fn, node, arr, srcs = call
        return lambda: fn(np, node, arr, srcs)
    return call


def median_us(call, reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    set_threads(args.threads)
    per_layer = {"add_rms_norm": 2, "rope (q)": 1, "rope_set_rows (k)": 1, "set_rows (v)": 1, "flash_attn": 1, "swiglu": 1,
                 "q/k/v (multi)": 1, "attn out": 1, "gate/up (multi)": 1, "ffn down": 1}
    for label, (n, n_kv, used) in {"decode, 1 token, n_kv 256 (100 used)": (1, 256, 100),
                                   "prompt, 512 tokens, n_kv 512": (512, 512, 512)}.items():
        print(f"{label} (-t {args.threads}): median us per call")
        print(f"  {'op':<20}{'numba':>10}{'numpy':>10}{'ratio':>8}{'numba GMAC/s':>14}")
        tot_c = tot_r = 0.0
        work = {name: (build, None) for name, build in cases(n, n_kv, used).items()} | products(n)
        for name, (build, macs) in work.items():
            reps = args.reps if n == 1 else max(5, args.reps // 5)
            c = median_us(prepared(CPUBackend(), build), reps)
            r = median_us(prepared(ReferenceBackend(), build), reps)
            tot_c += per_layer.get(name, 0) * c
            tot_r += per_layer.get(name, 0) * r
            rate = f"{macs / c / 1e3:>14.1f}" if macs else ""
            print(f"  {name:<20}{c:>10.1f}{r:>10.1f}{r / c:>8.1f}{rate}")
        print(f"  per step, {N_LAYER} layers of these nodes: numba {N_LAYER * tot_c / 1e3:.2f} ms, "
              f"numpy {N_LAYER * tot_r / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
