#!/usr/bin/env python3
"""The fused feed-forward node (mul_mat_glu) against the pair of nodes it replaces (mul_mat_multi
of gate and up, then swiglu/geglu) on the CPU, at SmolLM2-135M's shapes (Q4_1 576 -> 1536,
swiglu) and gemma-3-270m's (Q5_0 640 -> 2048, geglu with ggml's f16 table), weights repacked as at
load: each graph prepared once and replayed as a reused graph is, the two alternated rep by rep
so that a busy machine slows both alike; medians in microseconds and fused / pair.

    .venv/bin/python scripts/bench_glu.py                # -t 1
    .venv/bin/python scripts/bench_glu.py -t 2 --reps 400
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ggrun.core import ops  # noqa: E402
from ggrun.core.backends.cpu import CPUBackend, set_threads  # noqa: E402
from ggrun.core.dtypes import DType  # noqa: E402
from tests.core.backend_ops import Leafs, planned  # noqa: E402
from tests.core.test_cpu_matmul import weight_data  # noqa: E402

MODELS = {"SmolLM2 (Q4_1, 576 -> 1536, swiglu)": (DType.Q4_1, 576, 1536, "swiglu"),
          "gemma-3-270m (Q5_0, 640 -> 2048, geglu)": (DType.Q5_0, 640, 2048, "geglu")}


def ffn(dtype: DType, n_embd: int, n_ff: int, glu: str, n: int, fused: bool):
    """build(leafs) of the feed-forward's first half for n tokens, one node or the pair."""
    data = [weight_data(dtype, n_ff, n_embd, seed) for seed in (0, 1)]
    # products of the size a model's are (|x| < 10 mostly: the GELU table's branches go as they do there)
    x = (np.random.default_rng(2).standard_normal((n, n_embd)) / np.sqrt(n_embd)).astype(np.float32)

    def build(lf: Leafs):
        gate, up = (lf.weight(name, dtype, (n_ff, n_embd), raw) for name, raw in zip(("gate", "up"), data))
        for w in (gate, up):
            w.params["act_quant"] = "q8_0"
            lf.ctx.prepare_weight(w)
        xt = lf.input("x", DType.F32, x)
        if fused:
            return ops.mul_mat_glu(gate, up, xt, glu, f16_table=True)
        g, u = ops.mul_mat_multi((gate, up), xt, ("g", "u"))
        return ops.swiglu(g, u) if glu == "swiglu" else ops.geglu(g, u, f16_table=True)
    return build


def prepared(build):
    """The graph's prepared calls as one call, run once (its kernels loaded), and its output."""
    sched, sg, lf, out = planned(CPUBackend(), build)
    for t, data in lf.feeds.items():
        sched.set_tensor(t, data)
    sched.compute(sg)
    calls = [call for split in sg.splits for call in split.calls]

    def run() -> None:
        for call in calls:
            call()
    return run, sched.get_tensor(out)


def alternated_us(calls: list, reps: int) -> list[float]:
    """Median microseconds of each call, the calls taken in turn rep by rep."""
    times = [[] for _ in calls]
    for _ in range(reps):
        for call, ts in zip(calls, times):
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
    return [1e6 * statistics.median(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200, help="reps of a decode step (prompts take a tenth)")
    args = ap.parse_args()
    set_threads(args.threads)
    print(f"-t {args.threads}: median us per call, the pair and the fused node alternated")
    print("| shape | tokens | pair | fused | fused / pair |")
    print("|---|---|---|---|---|")
    for label, shape in MODELS.items():
        for n in (1, 4, 512):
            (pair, want), (fused, got) = (prepared(ffn(*shape, n, f)) for f in (False, True))
            assert np.array_equal(got, want), "the fused node must equal the pair bit for bit"
            p, f = alternated_us([pair, fused], args.reps if n < 512 else max(5, args.reps // 10))
            print(f"| {label} | {n} | {p:.1f} | {f:.1f} | {f / p:.3f} |")


if __name__ == "__main__":
    main()
