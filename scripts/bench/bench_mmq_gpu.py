#!/usr/bin/env python3
"""Where the CUDA weight products' paths cross: one product node of a model's shapes timed on the GPU through each
path that can serve it, at each token-row count: mmq (16 weight rows a block, warps split K; up to 64 rows), mmqt
(ggml's tile layout, whatever the weight's width) with K split where its tiles leave the GPU idle and without
(mmqt-1), and the weights decoded to f16 tiles for cuBLAS; and a prompt's experts (mul_mat_id) through each of
mmq_idt's tiles. Each node's step is captured as a CUDA graph and launched --reps times (node_times); medians in
microseconds, and each path's result's NMSE against the cuBLAS path's (the experts': against the reference
kernels').

On the device machine:

    python3 scripts/bench/bench_mmq_gpu.py [--rows 16,32,64,128,256,512] [--reps 10]
"""
from __future__ import annotations

import argparse
import statistics
from functools import lru_cache

import numpy as np

from ggrun.core import ops
from ggrun.core.backends.cuda import CUDABackend, experts, matmul
from ggrun.core.backends.cuda.module import MT_ID_TILES
from ggrun.core.backends.cuda.node_times import node_times
from ggrun.core.backends.op_harness import compare, nmse, planned, weight_data
from ggrun.core.dtypes import DType

BIG = 1 << 30
# path -> (matmul.MMQ_MAX_ROWS, matmul.MMQT_MAX_ROWS, matmul.MT_MAX_SPLIT) that sends a product through it
PATHS = {"mmq": (BIG, 0, 1), "mmqt": (matmul.GEMV_MAX_ROWS, BIG, matmul.MT_MAX_SPLIT),
         "mmqt-1": (matmul.GEMV_MAX_ROWS, BIG, 1), "cublas": (matmul.GEMV_MAX_ROWS, matmul.GEMV_MAX_ROWS, 1)}
# llama-1b (n_embd 2048, n_ff 8192, 32 q heads / 8 kv heads of 64): (name, type, heights, K, op)
PRODUCTS = (("qkv", DType.Q4_0, (2048, 512, 512), 2048, "multi"), ("attn_out", DType.Q4_0, (2048,), 2048, "one"),
            ("ffn_glu", DType.Q4_0, (8192, 8192), 2048, "glu"), ("ffn_out", DType.Q4_0, (2048,), 8192, "one"),
            ("ffn_glu q4_k", DType.Q4_K, (8192, 8192), 2048, "glu"), ("output", DType.Q4_0, (128256,), 2048, "one"))
# (name, type, experts, used, M, K, an activation row per slot) of a 512-token prompt
EXPERTS = (("qwen3moe gate", DType.Q4_K, 128, 8, 768, 2048, False), ("qwen3moe down", DType.Q4_K, 128, 8, 2048, 768, True),
           ("gpt-oss gate", DType.MXFP4, 32, 4, 2880, 2880, False), ("gpt-oss down", DType.MXFP4, 32, 4, 2880, 2880, True))


@lru_cache(maxsize=None)
def blocks(qt: DType, m: int, k: int, seed: int) -> np.ndarray:
    """A weight's random blocks, made once per shape."""
    return weight_data(qt, m, k, seed=seed)


def product(qt: DType, ms: tuple, k: int, op: str, n: int):
    data = [blocks(qt, m, k, i) for i, m in enumerate(ms)]
    x = (np.random.default_rng(n).standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def build(lf):
        ws = tuple(lf.weight(f"w{i}", qt, (m, k), d) for i, (m, d) in enumerate(zip(ms, data)))
        xt = lf.input("x", DType.F32, x)
        if op == "glu":
            return ops.mul_mat_glu(ws[0], ws[1], xt, "swiglu")
        if op == "multi":
            return ops.mul_mat_multi(ws, xt, tuple(f"p{i}" for i in range(len(ws))))[0].view_src
        return ops.mul_mat(ws[0], xt)
    return build


def expert_product(qt: DType, n_expert: int, used: int, m: int, k: int, per_slot: bool, n: int = 512):
    rng = np.random.default_rng(0)
    data = blocks(qt, n_expert * m, k, 1)
    x = (rng.standard_normal((n, used if per_slot else 1, k)) / np.sqrt(k)).astype(np.float32)
    ids = np.stack([rng.choice(n_expert, size=used, replace=False) for _ in range(n)]).astype(np.int32)

    def build(lf):
        return ops.mul_mat_id(lf.weight("w", qt, (n_expert, m, k), data), lf.input("x", DType.F32, x),
                              lf.input("ids", DType.I32, ids))
    return build


def timed(gpu, build, reps: int) -> tuple[float, np.ndarray]:
    """Median microseconds of the graph's heaviest node over reps runs, and the graph's output."""
    sched, sg, lf, out = planned(gpu, build)
    for t, data in lf.feeds.items():
        sched.set_tensor(t, data)
    sched.compute(sg)
    got = sched.get_tensor(out).astype(np.float64)
    runs = [node_times(sg, gpu) for _ in range(reps)]
    per_node = {name: [statistics.median(r[name][i] for r in runs) for i in range(len(ts))]
                for name, ts in runs[0].items()}
    return 1e3 * max(max(ts) for ts in per_node.values()), got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,64,128,256,512")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-experts", action="store_true")
    ap.add_argument("--products", default="", help="names of PRODUCTS to time, comma-separated (default: all)")
    a = ap.parse_args()
    gpu = CUDABackend(0)
    matmul.MT_WIDTH, matmul.MT_TALL_ROWS = 0.0, 0  # the row limits alone pick each path, whatever the weight's width
    rows = [int(r) for r in a.rows.split(",")]
    print(f"{'product':14s} {'rows':>5s} " + " ".join(f"{p + ' us':>10s}" for p in PATHS) + "   nmse vs cuBLAS")
    wanted = set(a.products.split(",")) if a.products else None
    for name, qt, ms, k, op in PRODUCTS:
        if wanted is not None and name not in wanted:
            continue
        for n in rows:
            times, outs = {}, {}
            for path, (mmq_max, mmqt_max, split) in PATHS.items():
                if path == "mmq" and not matmul.GEMV_MAX_ROWS < n <= 8 * max(matmul.MMQ_TILES):
                    continue
                matmul.MMQ_MAX_ROWS, matmul.MMQT_MAX_ROWS, matmul.MT_MAX_SPLIT = mmq_max, mmqt_max, split
                times[path], outs[path] = timed(gpu, product(qt, ms, k, op, n), a.reps)
            errs = " ".join(f"{p} {nmse(o, outs['cublas']):.1e}" for p, o in outs.items() if p != "cublas")
            print(f"{name:14s} {n:5d} " + " ".join(f"{times[p]:10.1f}" if p in times else f"{'-':>10s}" for p in PATHS)
                  + f"   {errs}", flush=True)
    if a.no_experts:
        return
    chosen = experts._id_tile
    print(f"\n{'experts (512 tokens)':22s} " + " ".join(f"{f'{wm}x{nt} us':>9s}" for wm, nt in MT_ID_TILES)
          + f" {'chosen':>7s}  nmse vs reference (each tile)")
    for name, qt, n_expert, used, m, k, per_slot in EXPERTS:
        build = expert_product(qt, n_expert, used, m, k, per_slot)
        times, errs = [], []
        for tile in MT_ID_TILES:  # mmq_idt's tile (WM, NT) forced, then the one experts._id_tile picks
            experts._id_tile = lambda per_expert, tile=tile: tile
            times.append(timed(gpu, build, a.reps)[0])
            errs.append(compare(gpu, build))
        experts._id_tile = chosen
        pick = chosen(512 * used / n_expert)
        print(f"{name:22s} " + " ".join(f"{t:9.1f}" for t in times) + f" {pick[0]}x{pick[1]:<5d}  "
              + " ".join(f"{e:.0e}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
