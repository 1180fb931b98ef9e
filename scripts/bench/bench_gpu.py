#!/usr/bin/env python3
"""ggrun's CUDA backend against llama.cpp's CUDA llama-bench, side by side in one run, on the GPU
machine: synthetic llama-1b Q4_0, llama-1b Q8_0 and llama-135m Q4_0 (../shared/tools/make_synthetic.py),
pp512 and tg128 with every layer offloaded. The two tools alternate per model and round, and the
table shows medians and the ratio ggrun / llama.cpp.

On the device machine, with the anchor directory carried (`bash ../shared/tools/cuda_anchor.sh
prepare .anchor` here first; it builds llama-bench there once, ~4 min, and writes the models):

    python3 scripts/bench/bench_gpu.py --anchor .anchor [--rounds 2] [--models llama-1b:q4_0,...]
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
LLAMA_BENCH = Path("/tmp/llama-cuda/llama.cpp/build/bin/llama-bench")
MODELS = "llama-1b:q4_0,llama-1b:q8_0,llama-135m:q4_0"


def prepare(anchor: Path, models: list[str]) -> None:
    """Build llama-bench and write the synthetic models where missing (cuda_anchor.sh does both; it
    also runs llama-bench once per model, which serves as the warm-up)."""
    if LLAMA_BENCH.exists() and all((SYNTH / f"{m.replace(':', '-')}.gguf").exists() for m in models):
        return
    subprocess.run(["bash", str(anchor / "cuda_anchor.sh"), "device", *models], check=True,
                   stdout=subprocess.DEVNULL)


def llama_cpp(model: Path) -> dict[str, float]:
    res = subprocess.run([str(LLAMA_BENCH), "-m", str(model), "-ngl", "99", "-p", "512", "-n", "128", "-r", "3",
                          "-o", "json"], check=True, capture_output=True, text=True)
    return speeds_of(res.stdout, "llama-bench")


def ggrun(model: Path) -> dict[str, float]:
    cmd = [sys.executable, "-c", "from ggrun.cli.app import main; main()", "bench", "-m", str(model), "-ngl", "99", "-p", "512", "-n", "128",
           "-r", "3", "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"ggrun bench failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return speeds_of(res.stdout, f"ggrun bench ({res.stderr[-2000:]!r})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchor", type=Path, required=True, help="directory made by cuda_anchor.sh prepare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", default=MODELS)
    a = ap.parse_args()
    models = a.models.split(",")
    prepare(a.anchor, models)
    runs: dict[tuple[str, str], dict[str, list[float]]] = {}
    for _ in range(a.rounds):
        for m in models:
            path = SYNTH / f"{m.replace(':', '-')}.gguf"
            for tool, fn in (("llama.cpp", llama_cpp), ("ggrun", ggrun)):
                for test, ts in fn(path).items():
                    runs.setdefault((m, test), {}).setdefault(tool, []).append(ts)
                    print(f"{m} {test} {tool}: {ts:.1f} t/s", file=sys.stderr, flush=True)
    file_mb = {m: os.path.getsize(SYNTH / f"{m.replace(':', '-')}.gguf") / 2**20 for m in models}
    print(f"| model | file MiB | test | llama.cpp t/s | ggrun t/s | ggrun / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for (m, test), by_tool in runs.items():
        lc, gg = statistics.median(by_tool["llama.cpp"]), statistics.median(by_tool["ggrun"])
        print(f"| {m} | {file_mb[m]:.0f} | {test} | {lc:,.0f} | {gg:,.0f} | {gg / lc:.3f} |")


if __name__ == "__main__":
    main()
