#!/usr/bin/env python3
"""The fused feed-forward node (mul_mat_glu) against the pair of nodes it replaces (mul_mat_multi
of gate and up, then swiglu/geglu) on the CPU, at SmolLM2-135M's shapes (Q4_1 576 -> 1536,
swiglu) and gemma-3-270m's (Q5_0 640 -> 2048, geglu with ggml's f16 table), weights repacked as at
load: each graph prepared once and replayed as a reused graph is, the two alternated rep by rep
so that a busy machine slows both alike; medians in microseconds and fused / pair.

With --model, whole decode steps and prompt micro-batches of a model instead: one session whose
graphs have the fused node and one whose CPU backend refuses it (so the feed-forward builder
falls back to the pair, today's graph before the node existed), stepped in turn; their logits
must be equal, bit for bit.

    .venv/bin/python scripts/bench/bench_glu.py                # -t 1
    .venv/bin/python scripts/bench/bench_glu.py -t 2 --reps 400
    .venv/bin/python scripts/bench/bench_glu.py -t 2 --model gemma3-270m --steps 128 --prompt 512
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, set_threads
from ggrun.core.backends.op_harness import Leafs, planned, weight_data
from ggrun.core.dtypes import DType
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.download import resolve_model

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


class PairCPU(CPUBackend):
    """The CPU backend without the fused node: the feed-forward builder falls back to the pair."""

    def supports_op(self, node) -> bool:
        return node.op != "mul_mat_glu" and super().supports_op(node)


def model_steps(model: str, steps: int, prompt: int, batches: int) -> None:
    """Decode steps and prompt micro-batches of two sessions of the model, pair and fused, in turn."""
    sessions = []
    for backend in (PairCPU(), CPUBackend()):
        m = Model.load(resolve_model(model), [backend])
        ubatch = max(512, prompt)
        sessions.append(Session(m, SessionParams(n_ctx=ubatch + 2 * steps + 64, n_batch=ubatch, n_ubatch=ubatch)))
    tokens = [100 + i % 1000 for i in range(prompt)]
    rows = {f"pp{prompt}": ([], []), "decode step": ([], [])}
    for rep in range(batches + 1):  # the first builds and loads what the others reuse
        logits = [timed(s, rows[f"pp{prompt}"][i] if rep else [], Batch.of_sequence(tokens), fresh=True)
                  for i, s in enumerate(sessions)]
        assert np.array_equal(*logits), "the fused node must give the pair's logits"
    for step in range(steps + 1):
        batch = Batch.of_sequence([42 + step % 100], start_pos=prompt + step)
        logits = [timed(s, rows["decode step"][i] if step else [], batch) for i, s in enumerate(sessions)]
        assert np.array_equal(*logits), "the fused node must give the pair's logits"
    print(f"{model}: median ms, the pair's session and the fused one in turn")
    print("| test | pair | fused | fused / pair |")
    print("|---|---|---|---|")
    for test, (pair, fused) in rows.items():
        p, f = 1e3 * statistics.median(pair), 1e3 * statistics.median(fused)
        print(f"| {test} | {p:.2f} | {f:.2f} | {f / p:.3f} |")


def timed(s: Session, times: list, batch: Batch, fresh: bool = False) -> np.ndarray:
    """The batch's logits; its time appended to `times` (the cache cleared first when fresh)."""
    if fresh:
        s.clear()
    t0 = time.perf_counter()
    logits = s.decode(batch)
    times.append(time.perf_counter() - t0)
    return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200, help="reps of a decode step (prompts take a tenth)")
    ap.add_argument("--model", help="time a model's decode steps and prompt batches instead (e.g. smollm2)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps of each session (--model)")
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the prompt micro-batch (--model)")
    ap.add_argument("--batches", type=int, default=8, help="prompt micro-batches of each session (--model)")
    args = ap.parse_args()
    set_threads(args.threads)
    if args.model:
        model_steps(args.model, args.steps, args.prompt, args.batches)
        return
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
