#!/usr/bin/env python3
"""Where the time of one decode step goes: every prepared kernel call of a reused decode graph
timed on its own (grouped by op and weight type), against the whole step as `Session.decode`
runs it; the rest is host overhead (inputs, scheduler, logits copy, Python between calls).

    .venv/bin/python scripts/decode_breakdown.py                 # SmolLM2, -t 1
    .venv/bin/python scripts/decode_breakdown.py -m gemma3-270m -t 2 --steps 64
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ggrun.core.backends.cpu import CPUBackend, set_threads  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402
from ggrun.loaders.download import resolve_model  # noqa: E402


def kind_of(node) -> str:
    """An op, with the stored type of its weight for products (e.g. `mul_mat q4_1`)."""
    if node.op == "mul_mat" and node.srcs[0].root.is_weight:
        return f"mul_mat {node.srcs[0].dtype}"
    return node.op


def timed(call, kind: str, totals: dict):
    def run() -> None:
        t0 = time.perf_counter()
        call()
        totals[kind] += time.perf_counter() - t0
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-fa", "--flash-attn", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    set_threads(args.threads)
    model = Model.load(resolve_model(args.model), [CPUBackend()])
    s = Session(model, SessionParams(n_ctx=512, n_ubatch=512, flash_attn=bool(args.flash_attn)))
    prompt = model.tokenizer.tokenize("The three most useful things to know about the ocean are", add_special=True)
    s.decode(Batch.of_sequence(prompt))
    pos = len(prompt)

    steps, per_kind, counts = [], defaultdict(list), defaultdict(int)
    for i in range(args.steps):
        t0 = time.perf_counter()
        s.decode(Batch.of_sequence([42], start_pos=pos + i))
        steps.append(time.perf_counter() - t0)
    sg = s.result.sg
    totals: dict[str, float] = defaultdict(float)
    for split in sg.splits:  # the same prepared calls, each wrapped in a timer, for the timed steps below
        split.calls = [timed(call, kind_of(node), totals) for node, call in zip(split.nodes, split.calls)]
    for i in range(args.steps):
        totals.clear()
        s.decode(Batch.of_sequence([42], start_pos=pos + args.steps + i))
        for k, v in totals.items():
            per_kind[k].append(v)
    for split in sg.splits:
        for node in split.nodes:
            counts[kind_of(node)] += 1

    step = statistics.median(steps)
    kernels = sum(statistics.median(v) for v in per_kind.values())
    n_nodes = sum(counts.values())
    print(f"{model.path.name}: -t {args.threads}, -fa {args.flash_attn}, n_kv {s.result.params.n_kv}, "
          f"{n_nodes} kernel calls per step ({n_nodes / model.hp.n_layer:.1f} per layer)")
    print(f"decode step (median of {args.steps}): {1e3 * step:.2f} ms = {1 / step:.1f} t/s")
    print("| kernel | calls | ms per step | share |")
    print("|---|---|---|---|")
    for k, v in sorted(per_kind.items(), key=lambda kv: -statistics.median(kv[1])):
        ms = 1e3 * statistics.median(v)
        print(f"| {k} | {counts[k]} | {ms:.3f} | {ms / (1e3 * step):.1%} |")
    host = step - kernels
    print(f"| host overhead (inputs, copies, logits, Python between calls) | - | {1e3 * host:.3f} | "
          f"{host / step:.1%} |")


if __name__ == "__main__":
    main()
