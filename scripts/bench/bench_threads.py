#!/usr/bin/env python3
"""Does the default thread count survive a shared machine? `ggrun bench` (prompt and generation speed)
at -t 1, at the default -t (llama.cpp's: the physical cores), and at the default with threads that spin
while they wait (the OpenMP and OpenBLAS defaults ggrun overrides), first as the machine is, then beside
busy-loop processes that this script starts (one per --busy); llama.cpp's llama-bench at its default
-t for comparison when it is built. Configurations alternate within each round; medians are printed.

    .venv/bin/python scripts/bench/bench_threads.py                 # SmolLM2, 3 rounds, 1 busy core
    .venv/bin/python scripts/bench/bench_threads.py --rounds 5 --busy 1 -m gemma3-270m
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

DEFAULT_LLAMA_BIN = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
KNOWN = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m": "gemma-3-270m-q4_k_m.gguf"}
# the libraries' own defaults: OpenMP waits by spinning 300,000 times, OpenBLAS for 2^28 cycles
SPINNING = {"GOMP_SPINCOUNT": "300000", "OPENBLAS_THREAD_TIMEOUT": "28"}


def ggrun_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("ggrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ggrun.cli.app"]


def speeds(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """t/s per test of a llama-bench-style JSON run (ggrun bench writes the same fields)."""
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"): float(r["avg_ts"])
            for r in json.loads(out.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2", help="a known model name or a GGUF path")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens (the BLAS path above 32)")
    ap.add_argument("-n", type=int, default=32, help="generated tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes to start for the second part")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_LLAMA_BIN)))
    args = ap.parse_args()
    cache = Path(os.environ.get("GGRUN_CACHE", Path.home() / ".cache" / "ggrun")).expanduser()
    path = cache / "models" / KNOWN[args.model] if args.model in KNOWN else Path(args.model)
    common = ["-m", str(path), "-p", str(args.p), "-n", str(args.n), "-r", "1", "-o", "json"]
    configs = {
        "ggrun -t 1": ([*ggrun_cmd(), "bench", *common, "-t", "1"], {}),
        "ggrun default -t": ([*ggrun_cmd(), "bench", *common], {}),
        "ggrun default -t, spinning waits": ([*ggrun_cmd(), "bench", *common], SPINNING),
    }
    llama = Path(args.llama_bin) / "llama-bench"
    if llama.exists():
        configs["llama-bench default -t"] = ([str(llama), *common], {})
    print(f"{path.name}, pp{args.p} and tg{args.n}, t/s, medians of {args.rounds} alternating rounds, "
          f"{os.cpu_count()} CPUs")
    for busy in (0, args.busy):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
            for _ in range(args.rounds):
                for name, (cmd, env) in configs.items():
                    runs[name].append(speeds(cmd, env))
        finally:
            for hog in hogs:
                hog.kill()
        print(f"\n### {'the machine as it is' if not busy else f'beside {busy} busy-loop process(es)'}")
        print(f"| configuration | pp{args.p} | tg{args.n} | tg vs ggrun -t 1 |")
        print("|---|---|---|---|")
        base = statistics.median(r[f"tg{args.n}"] for r in runs["ggrun -t 1"])
        for name, rs in runs.items():
            pp = statistics.median(r[f"pp{args.p}"] for r in rs)
            tg = statistics.median(r[f"tg{args.n}"] for r in rs)
            print(f"| {name} | {pp:.1f} | {tg:.1f} | {tg / base:.2f} |")


if __name__ == "__main__":
    main()
