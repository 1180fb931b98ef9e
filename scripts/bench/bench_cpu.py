#!/usr/bin/env python3
"""ggrun against llama.cpp on the CPU, side by side in one run: `ggrun bench` and `llama-bench`
alternate (pp512 and tg128, medians over rounds, and each round's ratio: the machine may be shared),
then peak RSS and time to first token of `ggrun run` and `llama-completion` on the same prompt; prints
every figure and the ratios, after the CPU's model, its SIMD flags and ggrun's instruction-set level
(GGRUN_CPU_ISA caps it: core/backends/cpu/isa.py).

A model is a known model's name, or PRESET:TYPE for a synthetic model of a real shape (loaders/synthetic.py's
write_synthetic, SPEED_PRESETS: random blocks, written once into a temporary folder), e.g. qwen3-0.6b:q4_k.

llama.cpp's tools come from `bash ../shared/tools/cpu_anchor.sh` (pass its directory with
--llama-bin or $LLAMA_BIN); where they are absent their column is skipped, and the output says so.

    .venv/bin/python scripts/bench/bench_cpu.py                  # SmolLM2 Q4_1 and gemma-3-270m Q4_K_M, -t 2
    .venv/bin/python scripts/bench/bench_cpu.py --models smollm2 --rounds 3 -t 1
    .venv/bin/python scripts/bench/bench_cpu.py --vs-isa avx2    # ggrun against itself at a lower level
    .venv/bin/python scripts/bench/bench_cpu.py --models qwen3-0.6b:q4_k,qwen3-0.6b:iq4_xs --speed-only
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gguf.constants import GGMLQuantizationType as QT

from ggrun.cli.bench_output import speeds_of
from ggrun.core.llm.bench import cpu_line
from ggrun.loaders.download import KNOWN_MODELS, model_path
from ggrun.loaders.synthetic import SPEED_PRESETS, write_synthetic

DEFAULT_ANCHOR = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
PROMPT = "The capital of France is"


def ggrun_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("ggrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ggrun.cli.app"]


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS in bytes, stdout) of one process (with `env` added to the environment)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            env={**os.environ, **env} if env else None)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return wall, usage.ru_maxrss * 1024, out.decode("utf-8", "replace")


def bench_speeds(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """t/s of pp and tg from a llama-bench-style JSON list (both tools write the same fields)."""
    _, _, out = run_measured(cmd, env)
    return speeds_of(out, cmd[0])


def bench_args(path: Path, threads: int, reps: int) -> list[str]:
    return ["-m", str(path), "-p", "512", "-n", "128", "-t", str(threads), "-r", str(reps), "-o", "json"]


def run_args(path: Path, threads: int, n: int) -> list[str]:
    return ["-m", str(path), "-p", PROMPT, "-n", str(n), "--temp", "0", "-t", str(threads)]


def fmt_ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def fmt(x: float | None, spec: str) -> str:
    return format(x, spec) if x is not None else "-"


class Other:
    """What ggrun is measured against: llama.cpp's tools, or ggrun itself at another instruction-set
    level (--vs-isa: GGRUN_CPU_ISA)."""

    def __init__(self, llama: Path | None, isa: str | None) -> None:
        self.llama, self.env = llama, {"GGRUN_CPU_ISA": isa} if isa else None
        self.name = f"ggrun at {isa}" if isa else "llama.cpp"
        self.runs = bool(llama or isa)

    def bench(self) -> list[str]:
        return [*ggrun_cmd(), "bench"] if self.env else [str(self.llama / "llama-bench")]

    def completion(self) -> list[str]:
        return [*ggrun_cmd(), "run", "-no-cnv"] if self.env else [str(self.llama / "llama-completion"), "-no-cnv"]


def resolve(name: str, folder: Path) -> Path | None:
    """The file of a known model (None, said, where it is not cached), or a synthetic PRESET:TYPE written into
    `folder`."""
    if ":" in name:
        preset, qtype = name.split(":")
        if preset not in SPEED_PRESETS:
            raise SystemExit(f"{preset}: not a synthetic preset ({', '.join(SPEED_PRESETS)})")
        return write_synthetic(folder / f"{preset}-{qtype}.gguf", preset, QT[qtype.upper()])
    path = model_path(KNOWN_MODELS[name])
    if not path.exists():
        print(f"{name}: not in the cache (ggrun models pull {name}); skipped")
        return None
    return path


def measure_model(path: Path, args, other: Other) -> None:
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        if other.runs:
            for k, v in bench_speeds([*other.bench(), *bench_args(path, args.threads, args.reps)], other.env).items():
                theirs.setdefault(k, []).append(v)
        for k, v in bench_speeds([*ggrun_cmd(), "bench", *bench_args(path, args.threads, args.reps)]).items():
            ours.setdefault(k, []).append(v)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n## {path.name}, -t {args.threads}, medians of {args.rounds} alternating rounds (-r {args.reps} each); "
          f"load average after: {load}")
    print(f"| test | {other.name} t/s | ggrun t/s | ggrun / {other.name} | each round's ratio |")
    print("|---|---|---|---|---|")
    for test in ("pp512", "tg128"):
        a = statistics.median(ours[test]) if test in ours else None
        b = statistics.median(theirs[test]) if test in theirs else None
        rounds = " ".join(fmt_ratio(x, y) for x, y in zip(ours.get(test, []), theirs.get(test, [])))
        print(f"| {test} | {fmt(b, '.1f')} | {fmt(a, '.1f')} | {fmt_ratio(a, b)} | {rounds or '-'} |")
    if args.speed_only:
        return

    first_ours, first_theirs, rss_ours, rss_theirs = [], [], [], []
    for _ in range(args.rounds):
        if other.runs:
            first_theirs.append(run_measured([*other.completion(), *run_args(path, args.threads, 1)], other.env)[0])
            rss_theirs.append(run_measured([*other.completion(), *run_args(path, args.threads, 16)], other.env)[1])
        first_ours.append(run_measured([*ggrun_cmd(), "run", "-no-cnv", *run_args(path, args.threads, 1)])[0])
        rss_ours.append(run_measured([*ggrun_cmd(), "run", "-no-cnv", *run_args(path, args.threads, 16)])[1])
    t_a, t_b = statistics.median(first_ours), statistics.median(first_theirs) if first_theirs else None
    m_a = max(rss_ours) / 2**20
    m_b = max(rss_theirs) / 2**20 if rss_theirs else None
    print(f"\n| whole process, -p {PROMPT!r} | {other.name} | ggrun run | ggrun / {other.name} |")
    print("|---|---|---|---|")
    print(f"| time to first token (-n 1), s | {fmt(t_b, '.2f')} | {t_a:.2f} | {fmt_ratio(t_a, t_b)} |")
    print(f"| peak RSS (-n 16), MiB | {fmt(m_b, '.0f')} | {m_a:.0f} | {fmt_ratio(m_a, m_b)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3-270m", help="known model names, comma-separated")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR)),
                    help="directory of llama.cpp's llama-bench and llama-completion")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two tools")
    ap.add_argument("-r", "--reps", type=int, default=2, help="repetitions inside each bench run")
    ap.add_argument("--speed-only", action="store_true", help="pp512 and tg128 only (no first token, no RSS)")
    ap.add_argument("--vs-isa", choices=("avx512", "avx2", "generic"),
                    help="measure against ggrun at this instruction-set level instead of llama.cpp")
    args = ap.parse_args()
    llama = Path(args.llama_bin)
    if not args.vs_isa and not (llama / "llama-bench").exists():
        print(f"llama.cpp's tools are not in {llama} (build them with `bash ../shared/tools/cpu_anchor.sh`); "
              "their column is skipped")
        llama = None
    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if (path := resolve(name.strip(), Path(tmp))) is not None:
                measure_model(path, args, Other(llama, args.vs_isa))


if __name__ == "__main__":
    main()
