"""Where a batched decode step's time goes: llama-batched-bench's generation phase (B sequences, one token
each per step) on a session, timed per step for each B, then one B under cProfile, so the host's share of
a step (Python, graph handling, copies) shows beside the device's.

Each step is run three ways: `decode` (every row's logits come back, as llama-batched-bench's decode
copies them), `greedy` (the argmax in the graph, ids back) and `sampled` (ops.sample in the graph with
llama.cpp's default chain, ids back).

On a GPU each mode's line also gives the GPU's time between events recorded on the backend's stream
around the step (host time beyond it is the host's share), and --kernels B prints the GPU time of B's
kernels by node kind (events around each kernel of the last step and of the last prompt micro-batch, run eagerly).

Usage: python scripts/bench/profile_batched.py -m MODEL [-ngl 99] [-npp 128] [-ntg 32] [-npl 1,16,64,128]
       [--profile 64] [--modes decode,greedy,sampled] [--kernels 64,128]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from ggrun.cli.common import load_model
from ggrun.core.llm.batched_bench import BatchedTest, _decode_in_batches, decode_batch, prompt_batch
from ggrun.core.llm.batched_sampler import BatchedSampler
from ggrun.core.llm.sampling import SamplingParams
from ggrun.core.llm.session import Session, SessionParams


def _gpu_stream(session: Session):
    """(the stream, the device index) of the backend that computes the logits, when it is a GPU (else None):
    events are made with that device current (another one's events cannot be recorded on its stream)."""
    backend = session.model.placement.output
    stream = getattr(backend, "stream", None)
    return None if stream is None else (stream, backend.index)


def steps(session: Session, test: BatchedTest, mode: str, n_batch: int) -> tuple[float, list[float], list[float]]:
    """Clear, the prompts, then test.tg decode steps in `mode`: the prompts' seconds, each step's, and each
    step's GPU milliseconds between events around it (empty without a GPU)."""
    t0 = time.perf_counter()
    session.clear()
    _decode_in_batches(session, prompt_batch(test), n_batch)
    t_pp = time.perf_counter() - t0
    sampler = BatchedSampler([SamplingParams(seed=i) for i in range(test.pl)], session.n_ctx)
    slots = np.arange(test.pl)
    on_gpu = _gpu_stream(session)
    out, gpu = [], []
    for i in range(test.tg):
        b = decode_batch(test, i)
        if on_gpu is not None:
            import cupy
            stream, index = on_gpu
            with cupy.cuda.Device(index):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
        t0 = time.perf_counter()
        if mode == "decode":
            session.decode(b)
        elif mode == "greedy":
            session.decode_greedy(b)
        else:
            ids = session.decode_sampled(b, sampler.rows(slots))
            sampler.accept_rows(slots, ids)
        out.append(time.perf_counter() - t0)
        if on_gpu is not None:
            with cupy.cuda.Device(index):
                end.record(stream)
                end.synchronize()
                gpu.append(cupy.cuda.get_elapsed_time(start, end))
    return t_pp, out, gpu


def kernel_table(session: Session, test: BatchedTest, n_batch: int) -> None:
    """GPU time of each node of B's last greedy decode step and of its last prompt micro-batch, by kind
    (core/backends/cuda/node_times.py: events around each kernel, run eagerly)."""
    from ggrun.core.backends.cuda.node_times import node_times, print_node_times

    gpu = session.model.placement.output
    session.clear()
    _decode_in_batches(session, prompt_batch(test), n_batch)
    print_node_times(node_times(session.result.sg, gpu), f"B={test.pl} last prompt micro-batch, GPU")
    for i in range(test.tg):
        session.decode_greedy(decode_batch(test, i))
    print_node_times(node_times(session.result.sg, gpu), f"B={test.pl} greedy decode step {test.tg}, GPU")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", required=True)
    ap.add_argument("-ngl", type=int, default=99)
    ap.add_argument("-npp", type=int, default=128)
    ap.add_argument("-ntg", type=int, default=32)
    ap.add_argument("-npl", default="1,16,64,128")
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("--profile", type=int, default=64, help="B whose steps run under cProfile (0: none)")
    ap.add_argument("--modes", default="decode,greedy,sampled")
    ap.add_argument("--kernels", default="", help="Bs (a list) whose kernels' GPU times are listed (none by default)")
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
            t_pp, t, gpu = steps(s, test, mode, 2048)
            med = float(np.median(t))
            dev = f"  GPU {float(np.median(gpu)):7.3f} ms" if gpu else ""
            print(f"B={pl:4d} {mode:8s} step median {1e3 * med:7.3f} ms{dev}  S_TG {pl / med:9.1f} t/s  "
                  f"S_PP {pl * a.npp / t_pp:9.1f} t/s", flush=True)
    for pl in [int(x) for x in a.kernels.split(",") if x]:
        kernel_table(s, BatchedTest(a.npp, a.ntg, pl), 2048)
    test = BatchedTest(a.npp, a.ntg, a.profile)
    for mode in modes if a.profile else ():
        steps(s, test, mode, 2048)
        prof = cProfile.Profile()
        prof.enable()
        steps(s, test, mode, 2048)
        prof.disable()
        print(f"== cProfile B={a.profile} {mode} ({a.ntg} steps, prompt included)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
