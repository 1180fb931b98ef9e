#!/usr/bin/env python3
"""Does the default thread count survive a shared machine? `ggrun bench` (prompt and generation speed)
at -t 1, at the default -t (llama.cpp's: the physical cores) with idle threads polling at the default
level (--poll 50: decode products split, the crowding watch holds decode steps on one thread beside
busy work) and with sleeping ones (--poll 0: only large products split), first as the machine is, then
beside busy-loop processes that this script starts (one per --busy); llama.cpp's llama-bench at its
default -t and --poll for comparison when it is built. Configurations alternate within each round;
medians are printed, and ggrun's over llama.cpp's.

    .venv/bin/python scripts/bench/bench_threads.py                 # SmolLM2, 3 rounds, 1 busy core
    .venv/bin/python scripts/bench/bench_threads.py --rounds 5 --busy 1 -m gemma3-270m
    .venv/bin/python scripts/bench/bench_threads.py -m qwen3-0.6b:q4_k -p 512 -n 128   # a synthetic preset
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gguf.constants import GGMLQuantizationType as QT

from ggrun.cli.bench_output import speeds_of
from ggrun.core.llm.bench import cpu_line
from ggrun.loaders.synthetic import SPEED_PRESETS, write_synthetic

DEFAULT_LLAMA_BIN = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
KNOWN = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m": "gemma-3-270m-q4_k_m.gguf"}


def ggrun_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("ggrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ggrun.cli.app"]


def speeds(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """t/s per test of a llama-bench-style JSON run (ggrun bench writes the same fields)."""
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return speeds_of(out.stdout, cmd[0])


def model_file(name: str, cache: Path, folder: Path) -> Path:
    """A known model's cached file, a synthetic PRESET:TYPE written into `folder`, or a GGUF path."""
    if name in KNOWN:
        return cache / "models" / KNOWN[name]
    preset, _, qtype = name.partition(":")
    if qtype and preset in SPEED_PRESETS:
        return write_synthetic(folder / f"{preset}-{qtype}.gguf", preset, QT[qtype.upper()])
    return Path(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2", help="a known model name, PRESET:TYPE or a GGUF path")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens (the BLAS path above 32)")
    ap.add_argument("-n", type=int, default=32, help="generated tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes to start for the second part")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_LLAMA_BIN)))
    args = ap.parse_args()
    cache = Path(os.environ.get("GGRUN_CACHE", Path.home() / ".cache" / "ggrun")).expanduser()
    with tempfile.TemporaryDirectory() as folder:
        measure(args, model_file(args.model, cache, Path(folder)))


def measure(args, path: Path) -> None:
    """Every configuration, alternating, as the machine is and beside the busy loops; the tables."""
    common = ["-m", str(path), "-p", str(args.p), "-n", str(args.n), "-r", "1", "-o", "json"]
    configs = {
        "ggrun -t 1": ([*ggrun_cmd(), "bench", *common, "-t", "1"], {}),
        "ggrun default -t (--poll 50)": ([*ggrun_cmd(), "bench", *common], {}),
        "ggrun default -t, --poll 0": ([*ggrun_cmd(), "bench", *common, "--poll", "0"], {}),
    }
    llama = Path(args.llama_bin) / "llama-bench"
    if llama.exists():
        configs["llama-bench default -t"] = ([str(llama), *common], {})
    print(f"{path.name}, pp{args.p} and tg{args.n}, t/s, medians of {args.rounds} alternating rounds, "
          f"{os.cpu_count()} CPUs\n{cpu_line()}")
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
        print(f"| configuration | pp{args.p} | tg{args.n} | tg vs ggrun -t 1 | pp vs llama.cpp | tg vs llama.cpp |")
        print("|---|---|---|---|---|---|")
        med = {name: {test: statistics.median(r[test] for r in rs) for test in rs[0]} for name, rs in runs.items()}
        theirs = med.get("llama-bench default -t")
        pp_key, tg_key = f"pp{args.p}", f"tg{args.n}"
        for name, m in med.items():
            vs = (f"{m[pp_key] / theirs[pp_key]:.2f} | {m[tg_key] / theirs[tg_key]:.2f}" if theirs else "- | -")
            vs_one = m[tg_key] / med["ggrun -t 1"][tg_key]
            print(f"| {name} | {m[pp_key]:.1f} | {m[tg_key]:.1f} | {vs_one:.2f} | {vs} |")


if __name__ == "__main__":
    main()
