"""Where a batched decode step's time goes: llama-batched-bench's generation phase (B sequences, one token
each per step) on a session, timed per step for each B, then one B under cProfile, so the host's share of
a step (Python, graph handling, copies) shows beside the device's.

Each step is run three ways: `decode` (every row's logits come back, as llama-batched-bench's decode
copies them), `greedy` (the argmax in the graph, ids back) and `sampled` (ops.sample in the graph with
llama.cpp's default chain, ids back).

Usage: python scripts/profile_batched.py -m MODEL [-ngl 99] [-npp 128] [-ntg 32] [-npl 1,16,64,128]
       [--profile 64] [--modes decode,greedy,sampled] [--kernels]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ggrun.cli.common import load_model  # noqa: E402
from ggrun.core.llm.batched_bench import BatchedTest, _decode_in_batches, decode_batch, prompt_batch  # noqa: E402
from ggrun.core.llm.batched_sampler import BatchedSampler  # noqa: E402
from ggrun.core.llm.sampling import SamplingParams  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402


def steps(session: Session, test: BatchedTest, mode: str, n_batch: int) -> tuple[float, list[float]]:
    """Clear, the prompts, then test.tg decode steps in `mode`: the prompts' seconds and each step's."""
    t0 = time.perf_counter()
    session.clear()
    _decode_in_batches(session, prompt_batch(test), n_batch)
    t_pp = time.perf_counter() - t0
    sampler = BatchedSampler([SamplingParams(seed=i) for i in range(test.pl)], session.n_ctx)
    slots = np.arange(test.pl)
    out = []
    for i in range(test.tg):
        b = decode_batch(test, i)
        t0 = time.perf_counter()
        if mode == "decode":
            session.decode(b)
        elif mode == "greedy":
            session.decode_greedy(b)
        else:
            ids = session.decode_sampled(b, sampler.rows(slots))
            sampler.accept_rows(slots, ids)
        out.append(time.perf_counter() - t0)
    return t_pp, out


def kernel_times(session: Session, reps: int = 3) -> None:
    """Each device step of the last graph run, timed alone with CUDA events (summed by op, then the
    slowest steps): where a step's device time goes."""
    import cupy

    by_op: dict[str, float] = defaultdict(float)
    steps_ms = []
    for split in session.result.sg.splits:
        calls = split.calls
        if not hasattr(calls, "steps"):
            continue
        b = split.backend
        with b._dev, b.stream:
            for i, step in enumerate(calls.steps):
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record(b.stream)
                for _ in range(reps):
                    step()
                e1.record(b.stream)
                e1.synchronize()
                ms = cupy.cuda.get_elapsed_time(e0, e1) / reps
                by_op[step.name] += ms
                steps_ms.append((ms, i, step.name))
    print(f"  device steps alone: {sum(by_op.values()):.3f} ms in all")
    for name, ms in sorted(by_op.items(), key=lambda x: -x[1])[:12]:
        print(f"    {name:24s} {ms:8.3f} ms")
    for ms, i, name in sorted(steps_ms, reverse=True)[:8]:
        print(f"    step {i:5d} {name:24s} {ms:8.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", required=True)
    ap.add_argument("-ngl", type=int, default=99)
    ap.add_argument("-npp", type=int, default=128)
    ap.add_argument("-ntg", type=int, default=32)
    ap.add_argument("-npl", default="1,16,64,128")
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("--profile", type=int, default=64)
    ap.add_argument("--modes", default="decode,greedy,sampled")
    ap.add_argument("--kernels", action="store_true", help="time each device step of the last graph alone")
    a = ap.parse_args()
    npl = [int(x) for x in a.npl.split(",")]
    modes = a.modes.split(",")
    m = load_model(a.m, a.ngl, quiet=True)
    ctx = max(pl * (a.npp + a.ntg) for pl in npl)
    s = Session(m, SessionParams(n_ctx=ctx, n_batch=2048, n_ubatch=a.ub, n_seq_max=max(npl)))
    for pl in npl:
        test = BatchedTest(a.npp, a.ntg, pl)
        for mode in modes:
            steps(s, test, mode, 2048)  # warm: graphs built and captured
            t_pp, t = steps(s, test, mode, 2048)
            med = float(np.median(t))
            print(f"B={pl:4d} {mode:8s} step median {1e3 * med:7.3f} ms  S_TG {pl / med:9.1f} t/s  "
                  f"S_PP {pl * a.npp / t_pp:9.1f} t/s", flush=True)
            if a.kernels:
                kernel_times(s)
    test = BatchedTest(a.npp, a.ntg, a.profile)
    for mode in modes:
        steps(s, test, mode, 2048)
        prof = cProfile.Profile()
        prof.enable()
        steps(s, test, mode, 2048)
        prof.disable()
        print(f"== cProfile B={a.profile} {mode} ({a.ntg} steps, prompt included)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
