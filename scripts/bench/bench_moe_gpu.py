#!/usr/bin/env python3
"""ggrun's CUDA backend against llama.cpp's CUDA llama-bench on mixture-of-experts models, side by side in one
run on the GPU machine: a Qwen3-30B-A3B-shaped Q4_K model (48 layers, 128 experts of 768, 8 used) and a
gpt-oss-20b-shaped MXFP4 model (24 layers, 32 experts of 2880, 4 used, attention sinks, window 128 on
alternate layers), written by loaders/synthetic.py's write_synthetic (random blocks, for speed only). Every layer
offloaded (-ngl 99), pp512 and tg128; the tools alternate per model and round, and the table shows medians,
the ratio ggrun / llama.cpp and issue 32's bar for it.

On the device machine (llama-bench in $LLB, as .anchor/dev_setup.sh unpacks it):

    python3 scripts/bench/bench_moe_gpu.py [--rounds 1] [--models qwen3-30b-a3b:q4_k,gpt-oss-20b:mxfp4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ggrun.cli.bench_output import speeds_of

ROOT = Path(__file__).resolve().parents[2]
SYNTH = Path("/tmp/synth")
MODELS = "qwen3-30b-a3b:q4_k,gpt-oss-20b:mxfp4"
# issue 32's bars: ggrun / llama.cpp at least this, per (preset, test)
BARS = {("qwen3-30b-a3b", "tg128"): 1.2, ("qwen3-30b-a3b", "pp512"): 1.0, ("gpt-oss-20b", "tg128"): 1.0}


def model_path(spec: str) -> Path:
    preset, qtype = spec.split(":")
    return SYNTH / f"{preset}-{qtype}.gguf"


def write_models(specs: list[str]) -> None:
    """Write the missing models at once, one process each (ggrun.loaders.synthetic: random blocks, mostly disk time)."""
    SYNTH.mkdir(parents=True, exist_ok=True)
    procs = []
    for spec in specs:
        path = model_path(spec)
        if not path.exists():
            preset, qtype = spec.split(":")
            tmp = path.with_suffix(".part")
            procs.append((subprocess.Popen([sys.executable, "-m", "ggrun.loaders.synthetic", str(tmp), preset, qtype],
                                           cwd=ROOT, stdout=subprocess.DEVNULL), tmp, path))
    for proc, tmp, path in procs:
        if proc.wait():
            raise SystemExit(f"writing {path.name} failed ({proc.returncode})")
        tmp.rename(path)


def _bench(cmd: list[str], tool: str, timeout: int) -> dict[str, float]:
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if res.returncode:
        raise SystemExit(f"{tool} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return speeds_of(res.stdout, f"{tool} ({res.stderr[-2000:]!r})")


def args_for(model: Path, reps: int) -> list[str]:
    return ["-m", str(model), "-ngl", "99", "-p", "512", "-n", "128", "-r", str(reps), "-o", "json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench's and ggrun bench's -r")
    ap.add_argument("--models", default=MODELS, help="preset:type,... (loaders/synthetic.py's SPEED_PRESETS)")
    ap.add_argument("--llama-bench", type=Path, default=Path(os.environ.get("LLB", "/tmp/llama-cuda/llama.cpp/build/bin"))
                    / "llama-bench")
    ap.add_argument("--timeout", type=int, default=240, help="seconds one tool's run on one model may take")
    ap.add_argument("--write-only", action="store_true", help="write the missing models and stop")
    a = ap.parse_args()
    specs = a.models.split(",")
    write_models(specs)
    if a.write_only:
        return
    tools = {"llama.cpp": [str(a.llama_bench)],
             "ggrun": [sys.executable, "-c", "from ggrun.cli.app import main; main()", "bench"]}
    runs: dict[tuple[str, str], dict[str, list[float]]] = {}
    for _ in range(a.rounds):
        for spec in specs:
            for tool, cmd in tools.items():
                for test, ts in _bench(cmd + args_for(model_path(spec), a.reps), tool, a.timeout).items():
                    runs.setdefault((spec, test), {}).setdefault(tool, []).append(ts)
                    print(f"{spec} {test} {tool}: {ts:.1f} t/s", file=sys.stderr, flush=True)
    print("| model | GiB | test | llama.cpp t/s | ggrun t/s | ggrun / llama.cpp | bar |")
    print("|---|---|---|---|---|---|---|")
    for (spec, test), by_tool in runs.items():
        lc, gg = statistics.median(by_tool["llama.cpp"]), statistics.median(by_tool["ggrun"])
        bar = BARS.get((spec.split(":")[0], test))
        verdict = "" if bar is None else f">= {bar} {'met' if gg / lc >= bar else 'NOT met'}"
        size = model_path(spec).stat().st_size / 2**30
        print(f"| {spec} | {size:.1f} | {test} | {lc:,.1f} | {gg:,.1f} | {gg / lc:.3f} | {verdict} |")


if __name__ == "__main__":
    main()
