#!/usr/bin/env python3
"""Where a prompt's time goes with layers split over GPUs: each split's start and end on its GPU (CUDA
events recorded around it by the scheduler's probe), and when the host issued it, for the micro-batches
of one pp run after two untimed runs (the first runs eagerly, the second captures the CUDA graphs). It
prints a timeline per micro-batch and, per GPU, how long it was busy against the run's span: two GPUs
that take turns (pipelining) are each busy for most of the span; GPUs that wait for each other are busy
for about half of it each.

    python3 scripts/tools/pipeline_timeline.py MODEL.gguf [--gpus 2] [--prompt 2048] [--ubatch 512]
"""
from __future__ import annotations

import argparse
import time

import cupy
import numpy as np

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cuda import CUDABackend
from ggrun.core.llm.generate import eval_prompt
from ggrun.core.llm.model import Model
from ggrun.core.llm.placement import DeviceSplit
from ggrun.core.llm.session import Session, SessionParams


class Timeline:
    """Timing events around every split a compute runs, on the split's own GPU, and the host's clock then."""

    def __init__(self, gpus: list[CUDABackend]) -> None:
        self.gpus = gpus
        self.index = {g.name: g.index for g in gpus}
        self.marks: list[tuple[str, str, object, float]] = []  # (backend, phase, event, host seconds)
        self.base: dict[str, object] = {}
        self.t0 = 0.0

    def start(self) -> None:
        for g in self.gpus:
            with cupy.cuda.Device(g.index):
                cupy.cuda.Device(g.index).synchronize()
        self.t0 = time.perf_counter()
        for g in self.gpus:
            self.base[g.name] = self._event(g)

    def _event(self, g: CUDABackend):
        with cupy.cuda.Device(g.index):
            ev = cupy.cuda.Event()
            ev.record(g.stream)
        return ev

    def __call__(self, split, phase: str) -> None:
        b = split.backend
        if isinstance(b, CUDABackend):
            self.marks.append((b.name, phase, self._event(b), time.perf_counter() - self.t0))

    def report(self) -> None:
        for g in self.gpus:
            with cupy.cuda.Device(g.index):
                cupy.cuda.Device(g.index).synchronize()
        busy: dict[str, float] = {}
        spans = []
        opened: dict[str, tuple[float, float]] = {}
        print(f"{'gpu':8} {'start ms':>9} {'end ms':>9} {'issued ms':>9}")
        for name, phase, ev, host in self.marks:
            with cupy.cuda.Device(self.index[name]):
                at = cupy.cuda.get_elapsed_time(self.base[name], ev)
            if phase == "start":
                opened[name] = (at, host)
                continue
            start, issued = opened.pop(name)
            busy[name] = busy.get(name, 0.0) + at - start
            spans.append(at)
            print(f"{name:8} {start:9.2f} {at:9.2f} {1e3 * issued:9.2f}")
        span = max(spans) if spans else 0.0
        print(f"span {span:.2f} ms; host issued the last split at {1e3 * self.marks[-1][3]:.2f} ms")
        for name, t in busy.items():
            print(f"{name}: busy {t:.2f} ms ({100 * t / span:.0f}% of the span)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    args = ap.parse_args()
    gpus = [CUDABackend(i) for i in range(args.gpus)]
    mode = "layer" if args.gpus > 1 else "none"
    model = Model.load(args.model, [*gpus, CPUBackend()], 99, split=DeviceSplit(mode=mode))
    s = Session(model, SessionParams(n_ctx=args.prompt + 256, n_batch=args.prompt, n_ubatch=args.ubatch))
    tokens = np.random.default_rng(0).integers(0, model.hp.n_vocab, args.prompt).tolist()
    for _ in range(3):
        s.clear()
        eval_prompt(s, tokens, args.prompt)
    print(f"pipeline slots {s.sched.n_copies}; splits per micro-batch {len(s.result.sg.splits)}")
    s.clear()
    tl = Timeline(gpus)
    s.sched.probe = tl
    tl.start()
    t0 = time.perf_counter()
    eval_prompt(s, tokens, args.prompt)
    wall = time.perf_counter() - t0
    s.sched.probe = None
    print(f"{args.gpus} GPU(s), pp{args.prompt}: {1e3 * wall:.1f} ms wall, {args.prompt / wall:.0f} t/s")
    tl.report()


if __name__ == "__main__":
    main()
