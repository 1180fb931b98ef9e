"""What graph reuse saves on SmolLM2: token generation with reuse on and off, measured side by side in
one run (alternating, so machine load hits both alike). Per setting: tg t/s, and the host time per
token spent building and planning graphs (Session.stats.build_s + plan_s over the generated tokens).
The target is that reuse removes at least 90% of that per-token build+plan time.

Usage: python scripts/bench/bench_reuse.py [-m MODEL.gguf] [-n 64] [-r 2] [-c 512] [-t THREADS]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from ggrun.core.backends.cpu import CPUBackend, set_threads
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.download import resolve_model

PROMPT = "The three most useful things to know about the ocean are"
TARGET = 0.90  # share of per-token build+plan time reuse must remove


@dataclass
class Run:
    reuse: bool
    tokens: list[int]
    seconds: float  # wall time of the decode steps
    build_s: float
    plan_s: float
    compute_s: float
    built: int
    reused: int

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def tps(self) -> float:
        return self.n / self.seconds

    @property
    def host_ms(self) -> float:
        """Build + plan milliseconds per generated token."""
        return 1e3 * (self.build_s + self.plan_s) / self.n


def generate(model: Model, prompt: list[int], n: int, n_ctx: int, reuse: bool) -> Run:
    """Greedy: the prompt (not timed), then n one-token decode steps, timed with their stats alone."""
    s = Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=512, graph_reuse=reuse))
    logits = s.decode(Batch.of_sequence(prompt, 0))[-1]
    st = s.stats
    b0, p0, c0, built0, reused0 = st.build_s, st.plan_s, st.compute_s, st.graphs_built, st.graphs_reused
    tokens = []
    t0 = time.perf_counter()
    for pos in range(len(prompt), len(prompt) + n):
        tokens.append(int(np.argmax(logits)))
        logits = s.decode(Batch.of_sequence([tokens[-1]], pos))[-1]
    secs = time.perf_counter() - t0
    return Run(reuse, tokens, secs, st.build_s - b0, st.plan_s - p0, st.compute_s - c0,
               st.graphs_built - built0, st.graphs_reused - reused0)


def describe(r: Run) -> str:
    return (f"reuse {'on ' if r.reuse else 'off'}  {r.n} tokens  {r.tps:6.2f} t/s  "
            f"build {1e3 * r.build_s / r.n:7.3f} ms/tok  plan {1e3 * r.plan_s / r.n:7.3f} ms/tok  "
            f"compute {1e3 * r.compute_s / r.n:7.2f} ms/tok  graphs built {r.built} reused {r.reused}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file or known model name (default: SmolLM2)")
    ap.add_argument("-n", type=int, default=64, help="tokens to generate per run")
    ap.add_argument("-r", type=int, default=2, help="repetitions (each runs reuse on and off, alternating order)")
    ap.add_argument("-c", type=int, default=512, help="context size")
    ap.add_argument("-t", type=int, default=None, help="BLAS threads")
    args = ap.parse_args()
    set_threads(args.t)
    path = resolve_model(args.model)
    model = Model.load(path, [CPUBackend()])
    prompt = model.tokenizer.tokenize(PROMPT, add_special=True)
    if len(prompt) + args.n > args.c:
        ap.error(f"prompt ({len(prompt)}) + -n {args.n} does not fit -c {args.c}")
    print(f"model {path.name}, prompt {len(prompt)} tokens, {args.n} generated per run, -c {args.c}, "
          f"{args.r} repetitions")
    generate(model, prompt, 4, args.c, True)  # warm-up: first-use costs stay out of the figures

    runs: dict[bool, list[Run]] = {True: [], False: []}
    for rep in range(args.r):
        for reuse in ((True, False) if rep % 2 == 0 else (False, True)):
            r = generate(model, prompt, args.n, args.c, reuse)
            runs[reuse].append(r)
            print(f"rep {rep}  {describe(r)}", flush=True)

    on, off = runs[True], runs[False]
    same = all(r.tokens == on[0].tokens for r in on + off)
    tps_on = statistics.fmean(r.tps for r in on)
    tps_off = statistics.fmean(r.tps for r in off)
    host_on = statistics.fmean(r.host_ms for r in on)
    host_off = statistics.fmean(r.host_ms for r in off)
    removed = 1 - host_on / host_off if host_off else 0.0
    print()
    print(f"tg t/s            reuse on {tps_on:8.2f}   reuse off {tps_off:8.2f}   ratio on/off {tps_on / tps_off:.3f}")
    print(f"build+plan ms/tok reuse on {host_on:8.3f}   reuse off {host_off:8.3f}   removed by reuse {100 * removed:.1f}%")
    print(f"same tokens with reuse on and off: {'yes' if same else 'NO'}")
    ok = removed >= TARGET and same
    print(f"target (reuse removes >= {100 * TARGET:.0f}% of per-token build+plan time): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
