#!/usr/bin/env python3
"""Decode attention alone on one GPU, for tuning its kernels (not a comparison with llama.cpp): each case's
flash_attn step (one token's groups of query heads over a causal cache, qwen3-30b-a3b's, gpt-oss-20b's and
llama-8b's shapes; `tok`: a step of many sequences, one token each over its own 129 cells, as the graph builder
marks it per_token; `shared`: each over a 1024-cell prefix they all share, then 72 cells of its own, as
parallel's requests share a system prompt) captured 20 times into one CUDA graph, best of 5 launches: microseconds a step, the kernels
it ran and their grids. `rows` runs the one-token cases with ops.DECODE_FEW_ROWS set to each FEW given.

    python3 scripts/bench/attn_decode_gpu.py new all 4,16
    PYTHONPATH=/tmp/other python3 scripts/bench/attn_decode_gpu.py main all   # another checkout as ggrun

usage: attn_decode_gpu.py TAG rows|tok|all [FEW,FEW,...]"""
import sys

import cupy
import numpy as np

import ggrun
from ggrun.core.backends.cuda import CUDABackend
from ggrun.core.backends.cuda import ops as cops
from ggrun.core.backends.cuda.binding import launches_of
from ggrun.core.backends.op_harness import cache_attention, planned
from ggrun.core.dtypes import DType

F16 = DType.F16
HIDE = -np.inf


def causal(n: int, n_kv: int, seen: int, window: int = 0) -> np.ndarray:
    """f16 [n, n_kv]: the last of n tokens sees the first `seen` cells (within `window` positions when given)."""
    m = np.full((n, n_kv), HIDE, np.float32)
    for t in range(n):
        hi = seen - n + t + 1
        m[t, max(0, hi - window) if window else 0:hi] = 0
    return m.astype(np.float16)


def own(n: int, per: int, seen: int) -> np.ndarray:
    """f16 [n, n * per]: token t sees the first `seen` cells of block t of `per` cells (its sequence's)."""
    m = np.full((n, n * per), HIDE, np.float32)
    for t in range(n):
        m[t, per * t:per * t + seen] = 0
    return m.astype(np.float16)


def shared(n: int, prefix: int, per: int, seen: int) -> np.ndarray:
    """f16 [n, prefix + n * per]: every token sees the first `prefix` cells (a shared system prompt), then the first
    `seen` cells of block t of `per` cells after them (its sequence's own)."""
    m = np.full((n, prefix + n * per), HIDE, np.float32)
    m[:, :prefix] = 0
    for t in range(n):
        m[t, prefix + per * t:prefix + per * t + seen] = 0
    return m.astype(np.float16)


def build_fn(n: int, hq: int, hk: int, d: int, mask: np.ndarray, sinks: bool = False, per_token: bool = False,
             shared: bool = False):
    """The graph builder of one fused attention over an f16 cache of mask.shape[1] cells (random data)."""
    rng = np.random.default_rng(0)
    n_kv = mask.shape[1]
    qd = rng.standard_normal((n, hq, d)).astype(np.float32)
    kd, vd = ((rng.standard_normal((n_kv, hk * d)) * 0.5).astype(np.float16) for _ in range(2))
    sd = rng.standard_normal(hq).astype(np.float32) if sinks else None
    return lambda lf: cache_attention(lf, F16, kd, vd, qd, mask, sd, q_f16=True, per_token=per_token,
                                      shared=shared)


def time_attn(gpu, build, reps: int = 20) -> tuple[float, list[str], list[tuple]]:
    """Microseconds of the graph's flash_attn step (reps launches captured in one CUDA graph, best of 5), with
    the names and grids of the kernels it launches."""
    sched, sg, leafs, out = planned(gpu, build)
    for t, data in leafs.feeds.items():
        sched.set_tensor(t, data)
    sched.compute(sg)
    split = [sp for sp in sg.splits if sp.backend is gpu][0]
    steps = [st for node, st in zip(split.nodes, split.calls.steps) if node.op == "flash_attn"]
    step = steps[0]
    names = [getattr(la.kernel, "name", "?") for la in launches_of([step]) if la is not None]
    grids = [tuple(la.grid) for la in launches_of([step]) if la is not None]
    stream = gpu.stream
    with gpu._dev, stream:
        stream.begin_capture()
        for _ in range(reps):
            step()
        g = stream.end_capture()
        g.launch(stream)
        stream.synchronize()
        best = float("inf")
        for _ in range(5):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            g.launch(stream)
            b.record(stream)
            b.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(a, b))
    return 1e3 * best / reps, names, grids


ROWS = {  # name: (n, hq, hk, d, mask, sinks)
    "q3-140": (1, 32, 4, 128, causal(1, 256, 140), False),
    "q3-1000": (1, 32, 4, 128, causal(1, 1024, 1000), False),
    "q3-4000": (1, 32, 4, 128, causal(1, 4096, 4000), False),
    "q3-t2-141": (2, 32, 4, 128, causal(2, 256, 141), False),
    "oss-140-sink": (1, 64, 8, 64, causal(1, 256, 140), True),
    "oss-win128-1000": (1, 64, 8, 64, causal(1, 1024, 1000, 128), True),
    "oss-1000-sink": (1, 64, 8, 64, causal(1, 1024, 1000), True),
    "l8b-140": (1, 32, 8, 128, causal(1, 256, 140), False),
}
TOK = {
    "l1b-B64": (64, 32, 8, 64, own(64, 256, 129), False),
    "l1b-B128": (128, 32, 8, 64, own(128, 256, 129), False),
    "q3-B64": (64, 32, 4, 128, own(64, 256, 129), False),
    "oss-B64": (64, 64, 8, 64, own(64, 256, 129), True),
    "l1b-B64-shared1024+72": (64, 32, 8, 64, shared(64, 1024, 128, 72), False),
    "l1b-B16-shared1024+72": (16, 32, 8, 64, shared(16, 1024, 128, 72), False),
    "l1b-B128-shared1024+72": (128, 32, 8, 64, shared(128, 1024, 128, 72), False),
}

def main() -> None:
    tag, which = sys.argv[1], sys.argv[2]
    fews = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [cops.DECODE_FEW_ROWS]
    print(f"[{tag}] ggrun from {list(ggrun.__path__)}", flush=True)
    gpu = CUDABackend(0)
    if which in ("rows", "all"):
        for few in fews:
            cops.DECODE_FEW_ROWS = few
            for name, (n, hq, hk, d, mask, sinks) in ROWS.items():
                us, names, grids = time_attn(gpu, build_fn(n, hq, hk, d, mask, sinks))
                print(f"[{tag}] rows few={few:2d} {name:18s} {us:7.2f} us  {names} {grids}", flush=True)
    if which in ("tok", "all"):
        for name, (n, hq, hk, d, mask, sinks) in TOK.items():
            for shared in (False, True) if "shared" in name or name == "l1b-B64" else (False,):
                us, names, grids = time_attn(gpu, build_fn(n, hq, hk, d, mask, sinks, per_token=True, shared=shared))
                print(f"[{tag}] tok {name:18s} {'cascade' if shared else 'per token':9s} {us:7.2f} us  {names} "
                      f"{grids}", flush=True)


if __name__ == "__main__":
    main()
