#!/usr/bin/env python3
"""One model over two GPUs against one GPU, ggrun and llama.cpp's CUDA llama-bench side by side: the
synthetic llama-8b Q4_0 (../shared/tools/make_synthetic.py), pp2048 and tg128 with every layer offloaded,
on one GPU (-sm none -mg 0), split by layers (-sm layer -ts 1,1: micro-batches pipelined over the two)
and split by rows (-sm row -ts 1,1). It prints each tool's t/s, each split's ratio to the same tool on
one GPU, and the issue's bars: pp2048 with layers split at least 1.6x one GPU, tg128 within 10% of it;
and whether ggrun's greedy tokens with each split equal its tokens on one GPU.

On a machine with two or more GPUs, with the anchor directory carried (`bash ../shared/tools/cuda_anchor.sh
prepare .anchor` here first; on the machine it builds llama-bench once, ~4 min, and writes the model):

    python3 scripts/bench_multi_gpu.py --anchor .anchor [--rounds 2] [--model llama-8b:q4_0]

With fewer than two GPUs it says so and exits 0: there is nothing to split.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYNTH = Path("/tmp/synth")
LLAMA_BENCH = Path("/tmp/llama-cuda/llama.cpp/build/bin/llama-bench")
GGRUN = [sys.executable, "-c", "from ggrun.cli.app import main; main()"]
TESTS = ["-ngl", "99", "-p", "2048", "-n", "128", "-b", "2048", "-ub", "512", "-r", "3", "-o", "json"]
# (label, options for both tools' bench; llama-bench and ggrun bench both read '/' inside one -ts value)
SPLITS = [("1 GPU", ["-sm", "none", "-mg", "0"]),
          ("layer 1,1", ["-sm", "layer", "-ts", "1/1"]),
          ("row 1,1", ["-sm", "row", "-ts", "1/1"])]
PROMPT = "The three most useful things to know about the ocean are"
PP_BAR, TG_BAR = 1.6, 0.9  # the acceptance: pipelined prompts 1.6x one GPU, generation within 10%


def gpu_count() -> int:
    """GPUs cupy sees (0 without cupy or a driver)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver: no GPU for this script
        return 0


def prepare(anchor: Path, model: str) -> Path:
    """llama-bench built and the model written (cuda_anchor.sh does both, and runs llama-bench once)."""
    path = SYNTH / f"{model.replace(':', '-')}.gguf"
    if not (LLAMA_BENCH.exists() and path.exists()):
        subprocess.run(["bash", str(anchor / "cuda_anchor.sh"), "device", model], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def _rates(stdout: str, tool: str) -> dict[str, float]:
    """{"pp2048": t/s, "tg128": t/s} from llama-bench-style JSON rows."""
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"{tool} printed no JSON: {stdout[-1000:]!r}") from None
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"): float(r["avg_ts"]) for r in rows}


def bench(tool: str, model: Path, split: list[str]) -> dict[str, float]:
    cmd = [str(LLAMA_BENCH)] if tool == "llama.cpp" else [*GGRUN, "bench"]
    res = subprocess.run([*cmd, "-m", str(model), *TESTS, *split], capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"{tool} bench {' '.join(split)} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return _rates(res.stdout, tool)


def greedy_text(model: Path, split: list[str]) -> str:
    """ggrun's greedy continuation with the split's options (-ts as run spells it)."""
    opts = [o.replace("/", ",") for o in split]
    res = subprocess.run([*GGRUN, "run", "-m", str(model), "-p", PROMPT, "-n", "32", "--temp", "0", "-no-cnv",
                          "-c", "512", "-ngl", "99", *opts], capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"ggrun run {' '.join(opts)} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return res.stdout


def report(runs: dict, texts: dict[str, str]) -> None:
    """The table of medians, each split against the same tool on one GPU, and the issue's bars."""
    med = {key: statistics.median(v) for key, v in runs.items()}
    print("| split | test | llama.cpp t/s | ggrun t/s | ggrun / llama.cpp | llama.cpp / its 1 GPU | ggrun / its 1 GPU |")
    print("|---|---|---|---|---|---|---|")
    for label, _ in SPLITS:
        for test in ("pp2048", "tg128"):
            lc, gg = med[(label, test, "llama.cpp")], med[(label, test, "ggrun")]
            lc1, gg1 = med[("1 GPU", test, "llama.cpp")], med[("1 GPU", test, "ggrun")]
            print(f"| {label} | {test} | {lc:,.1f} | {gg:,.1f} | {gg / lc:.3f} | {lc / lc1:.3f} | {gg / gg1:.3f} |")
    pp = med[("layer 1,1", "pp2048", "ggrun")] / med[("1 GPU", "pp2048", "ggrun")]
    tg = med[("layer 1,1", "tg128", "ggrun")] / med[("1 GPU", "tg128", "ggrun")]
    print(f"\nggrun -sm layer -ts 1,1 / one GPU: pp2048 {pp:.2f}x (bar {PP_BAR}x: {'met' if pp >= PP_BAR else 'NOT met'}), "
          f"tg128 {tg:.2f}x (bar {TG_BAR}x: {'met' if tg >= TG_BAR else 'NOT met'})")
    for label, _ in SPLITS[1:]:
        same = texts[label] == texts["1 GPU"]
        print(f"greedy tokens, {label} vs one GPU: {'equal' if same else 'DIFFER'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchor", type=Path, required=True, help="directory made by cuda_anchor.sh prepare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="llama-8b:q4_0", help="PRESET:TYPE for make_synthetic.py")
    a = ap.parse_args()
    n = gpu_count()
    if n < 2:
        print(f"bench_multi_gpu: {n} GPU(s) here; splitting a model needs two or more, so nothing is measured")
        return 0
    model = prepare(a.anchor, a.model)
    texts = {label: greedy_text(model, split) for label, split in SPLITS}
    runs: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(a.rounds):  # the tools alternate per split and round
        for label, split in SPLITS:
            for tool in ("llama.cpp", "ggrun"):
                for test, ts in bench(tool, model, split).items():
                    runs.setdefault((label, test, tool), []).append(ts)
                    print(f"{label} {test} {tool}: {ts:.1f} t/s", file=sys.stderr, flush=True)
    report(runs, texts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
