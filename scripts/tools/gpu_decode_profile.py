#!/usr/bin/env python3
"""Where a CUDA decode step's time goes: tokens per second of decode steps with CUDA graphs on and
off, and the GPU time of each kernel of one step (CUDA events around each bound step), summed by
node kind. Run on the GPU machine:

    python3 scripts/tools/gpu_decode_profile.py -m MODEL.gguf [-n 64] [-p 32]
    ncu --metrics gpu__time_duration.sum --print-summary per-kernel \
        python3 scripts/tools/gpu_decode_profile.py -m MODEL.gguf --steps-only   # each kernel's GPU time
"""
from __future__ import annotations

import argparse
import time

import cupy

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cuda import CUDABackend
from ggrun.core.backends.cuda.node_times import node_times, print_node_times
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams


def decode_rate(path: str, graphs: bool, n_prompt: int, n_gen: int) -> tuple[float, Session, CUDABackend]:
    gpu = CUDABackend(0)
    gpu.use_graphs = graphs
    s = Session(Model.load(path, [gpu, CPUBackend()], 999), SessionParams(n_ctx=1024, n_ubatch=512))
    s.decode(Batch.of_sequence(list(range(1, n_prompt + 1))))
    for i in range(3):  # warm: compile, capture
        s.decode(Batch.of_sequence([5], n_prompt + i))
    t0 = time.perf_counter()
    for i in range(n_gen):
        s.decode(Batch.of_sequence([7], n_prompt + 3 + i))
    return n_gen / (time.perf_counter() - t0), s, gpu


def step_times(s: Session, gpu: CUDABackend, n_prompt: int, n: int = 20) -> tuple[float, float]:
    """(host ms, GPU ms) of a decode step: wall time of Session.decode, and device time between
    events around the whole step on the stream."""
    host, dev = [], []
    for i in range(n):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(gpu.stream)
        t0 = time.perf_counter()
        s.decode(Batch.of_sequence([9], n_prompt + 100 + i))
        host.append(time.perf_counter() - t0)
        end.record(gpu.stream)
        end.synchronize()
        dev.append(cupy.cuda.get_elapsed_time(start, end))
    return 1e3 * sorted(host)[n // 2], sorted(dev)[n // 2]


def replay_ms(s: Session, gpu: CUDABackend, n: int = 50) -> float:
    """GPU milliseconds of one replay of the decode graph's captured CUDA splits and their input copies."""
    splits = [sp for sp in s.result.sg.splits if sp.backend is gpu and sp.calls is not None]
    if not splits or any(sp.calls.graph is None for sp in splits):
        return float("nan")
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(gpu.stream)
    for _ in range(n):
        for sp in splits:  # the inputs' copies too: later nodes reuse their memory
            for c in sp.copies:
                gpu.copy_tensor(c.srcs[0], c)
            sp.calls.graph.launch(gpu.stream)
    end.record(gpu.stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / n


def host_profile(s: Session, n_prompt: int, n: int = 64) -> None:
    """cProfile of decode steps: where the host's time per token goes."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        s.decode(Batch.of_sequence([11], n_prompt + 200 + i))
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def prompt_profile(path: str, n_prompt: int = 512) -> None:
    """Wall and GPU time of prompt micro-batches of n_prompt tokens, and where the host's time goes."""
    import cProfile
    import pstats

    gpu = CUDABackend(0)
    s = Session(Model.load(path, [gpu, CPUBackend()], 999), SessionParams(n_ctx=2048, n_ubatch=512))
    tokens = list(range(1, n_prompt + 1))
    for _ in range(2):  # warm: compile, cuBLAS heuristics
        s.seq_rm(0)
        s.decode(Batch.of_sequence(tokens))
    prof = cProfile.Profile()
    walls, gpus = [], []
    for _ in range(3):
        s.seq_rm(0)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(gpu.stream)
        t0 = time.perf_counter()
        prof.enable()
        s.decode(Batch.of_sequence(tokens))
        prof.disable()
        walls.append(time.perf_counter() - t0)
        end.record(gpu.stream)
        end.synchronize()
        gpus.append(cupy.cuda.get_elapsed_time(start, end))
    print(f"prompt of {n_prompt}: {n_prompt / min(walls):.0f} t/s; {1e3 * min(walls):.2f} ms wall, "
          f"{min(gpus):.2f} ms between stream events")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-p", type=int, default=32)
    ap.add_argument("--cprofile", action="store_true", help="profile the host side of decode steps")
    ap.add_argument("--prompt", action="store_true", help="profile a 512-token prompt micro-batch instead")
    ap.add_argument("--steps-only", action="store_true",
                    help="only a prompt and three eager decode steps, for a kernel profiler (ncu)")
    a = ap.parse_args()
    if a.steps_only:
        decode_rate(a.model, False, a.p, 3)
        return
    if a.prompt:
        prompt_profile(a.model)
        return
    for graphs in (True, False):
        rate, s, gpu = decode_rate(a.model, graphs, a.p, a.n)
        host, dev = step_times(s, gpu, a.p + a.n)
        print(f"decode with CUDA graphs {'on ' if graphs else 'off'}: {rate:8.1f} t/s ({1e3 / rate:.3f} ms/token;"
              f" median step {host:.3f} ms on the host, {dev:.3f} ms between stream events)")
        if graphs:
            print(f"  GPU time of the captured decode graph alone: {replay_ms(s, gpu):.3f} ms")
            if a.cprofile:
                host_profile(s, a.p + a.n)
    print_node_times(node_times(s.result.sg, gpu), "GPU time of one step, kernel by kernel")


if __name__ == "__main__":
    main()
