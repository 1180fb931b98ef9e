#!/usr/bin/env python3
"""Where the time of one decode step goes: every prepared kernel call of a reused decode graph
timed on its own (grouped by op and weight type), against the whole step as `Session.decode`
runs it; the rest is host overhead (inputs, scheduler, logits copy, Python between calls).
With --prompt N, the same for one N-token prompt micro-batch (llama-bench's ppN).

    .venv/bin/python scripts/tools/decode_breakdown.py                 # SmolLM2, -t 1
    .venv/bin/python scripts/tools/decode_breakdown.py -m gemma3-270m -t 2 --steps 64
    .venv/bin/python scripts/tools/decode_breakdown.py --prompt 512 --steps 3
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from ggrun.core.backends.cpu import CPUBackend, set_threads
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.download import resolve_model


def kind_of(node) -> str:
    """An op, with the stored types of its weights for products (e.g. `mul_mat q4_1`,
    `mul_mat_multi q5_0+q5_0+q8_0`, `mul_mat_glu q5_0+q5_0`)."""
    if node.op == "mul_mat" and node.srcs[0].root.is_weight:
        return f"mul_mat {node.srcs[0].dtype}"
    if node.op in ("mul_mat_multi", "mul_mat_glu"):
        return f"{node.op} {'+'.join(str(w.dtype) for w in node.srcs[:-1])}"
    return node.op


def timed(call, kind: str, totals: dict):
    def run() -> None:
        t0 = time.perf_counter()
        call()
        totals[kind] += time.perf_counter() - t0
    return run


class TimedCPU(CPUBackend):
    """The CPU backend with every call it prepares timed into `totals` by kind (prompt batches
    clear the cache, so each gets a graph prepared afresh)."""

    def __init__(self) -> None:
        super().__init__()
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = {}

    def prepare(self, nodes):
        self.counts = defaultdict(int)
        for node in nodes:
            self.counts[kind_of(node)] += 1
        return [timed(call, kind_of(node), self.totals) for node, call in zip(nodes, super().prepare(nodes))]


def decode_steps(s: Session, steps: int) -> tuple[list[float], dict, dict]:
    """Step times of plain decode steps, then per-kind kernel times of as many steps again with
    the same prepared calls wrapped in timers; and the calls per kind."""
    prompt = s.model.tokenizer.tokenize("The three most useful things to know about the ocean are", add_special=True)
    s.decode(Batch.of_sequence(prompt))
    pos = len(prompt)
    times, per_kind, counts = [], defaultdict(list), defaultdict(int)
    for i in range(steps):
        t0 = time.perf_counter()
        s.decode(Batch.of_sequence([42], start_pos=pos + i))
        times.append(time.perf_counter() - t0)
    sg = s.result.sg
    totals: dict[str, float] = defaultdict(float)
    for split in sg.splits:
        split.calls = [timed(call, kind_of(node), totals) for node, call in zip(split.nodes, split.calls)]
        for node in split.nodes:
            counts[kind_of(node)] += 1
    for i in range(steps):
        totals.clear()
        s.decode(Batch.of_sequence([42], start_pos=pos + steps + i))
        for k, v in totals.items():
            per_kind[k].append(v)
    return times, per_kind, counts


def prompt_batches(s: Session, backend: TimedCPU, n_tokens: int, reps: int) -> tuple[list[float], dict, dict]:
    """Times of one n_tokens prompt micro-batch into an empty cache, per kind and whole."""
    tokens = [100 + i % 1000 for i in range(n_tokens)]
    times, per_kind = [], defaultdict(list)
    for i in range(reps + 1):  # the first builds what later ones reuse (and loads the kernels)
        s.clear()
        backend.totals.clear()
        t0 = time.perf_counter()
        s.decode(Batch.of_sequence(tokens))
        if i:
            times.append(time.perf_counter() - t0)
            for k, v in backend.totals.items():
                per_kind[k].append(v)
    return times, per_kind, backend.counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-fa", "--flash-attn", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="decode steps (or prompt batches) timed")
    ap.add_argument("--prompt", type=int, default=0, help="break down one prompt micro-batch of this many tokens")
    args = ap.parse_args()
    set_threads(args.threads)
    backend = TimedCPU() if args.prompt else CPUBackend()
    model = Model.load(resolve_model(args.model), [backend])
    n_ubatch = max(512, args.prompt)
    s = Session(model, SessionParams(n_ctx=max(512, args.prompt), n_batch=n_ubatch, n_ubatch=n_ubatch,
                                     flash_attn=bool(args.flash_attn)))
    if args.prompt:
        times, per_kind, counts = prompt_batches(s, backend, args.prompt, args.steps)
        what, per = f"prompt micro-batch of {args.prompt} tokens", "batch"
    else:
        times, per_kind, counts = decode_steps(s, args.steps)
        what, per = "decode step", "step"

    step = statistics.median(times)
    kernels = sum(statistics.median(v) for v in per_kind.values())
    n_nodes = sum(counts.values())
    rate = (args.prompt or 1) / step
    print(f"{model.path.name}: -t {args.threads}, -fa {args.flash_attn}, n_kv {s.result.params.n_kv}, "
          f"{n_nodes} kernel calls per {per} ({n_nodes / model.hp.n_layer:.1f} per layer)")
    print(f"{what} (median of {args.steps}): {1e3 * step:.2f} ms = {rate:.1f} t/s")
    print(f"| kernel | calls | ms per {per} | share |")
    print("|---|---|---|---|")
    for k, v in sorted(per_kind.items(), key=lambda kv: -statistics.median(kv[1])):
        ms = 1e3 * statistics.median(v)
        print(f"| {k} | {counts[k]} | {ms:.3f} | {ms / (1e3 * step):.1%} |")
    host = step - kernels
    print(f"| host overhead (inputs, copies, logits, Python between calls) | - | {1e3 * host:.3f} | "
          f"{host / step:.1%} |")


if __name__ == "__main__":
    main()
