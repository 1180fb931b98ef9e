"""Many sequences at once, ggrun against llama.cpp, side by side in one run: `ggrun bench --batched` and
llama.cpp's `llama-batched-bench` with the same options (-npp, -ntg, -npl, -c, -b, -ub, -t, -ngl, -fa),
alternating row by row and round by round, each tool as its own process per row (ggrun's rows warmed up
untimed first, as `bench --batched` does by default; --cold without); prints both tables'
speeds and the ratios (ggrun / llama.cpp) of S_PP and S_TG per B, medians over the rounds, for each model of
a comma list (default SmolLM2 and gemma-3-270m), then per model the lowest S_TG ratio against --target
(issue 31's CPU bar: 1.2x at every B).

llama.cpp's tools come from `bash /work/shared/tools/cpu_anchor.sh` (on a GPU machine cuda_anchor.sh, whose
bin directory is /tmp/llama-cuda/llama.cpp/build/bin; run with -ngl 99 and the header names the GPU);
pass the directory with --llama-bin or $LLAMA_BIN. Where llama-batched-bench is absent, only ggrun's
figures are printed, and the output says so.

Usage: python scripts/bench/bench_batched.py [-m smollm2,gemma3-270m] [-npp 128] [-ntg 128] [-npl 1,2,4,8,16] [-t 2]
                                      [--rounds 2] [--target 1.2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from ggrun.loaders.download import resolve_model

DEFAULT_ANCHOR = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"


def ggrun_exe() -> list[str]:
    venv = ROOT / ".venv/bin/ggrun"
    return [str(venv)] if venv.exists() else [sys.executable, "-m", "ggrun.cli.app"]


def resolve(model: str) -> str:
    """A known model name as ggrun resolves it (llama.cpp needs the file)."""
    return model if Path(model).is_file() else str(resolve_model(model))


def common_args(a, pl: int) -> list[str]:
    args = ["-npp", str(a.npp), "-ntg", str(a.ntg), "-npl", str(pl), "-c", str(a.ctx_for(pl)),
            "-b", str(a.batch_size), "-ub", str(a.ubatch_size), "-ngl", str(a.n_gpu_layers)]
    if a.threads:
        args += ["-t", str(a.threads)]
    if a.pps:
        args.append("-pps")
    return args


def run_ggrun(a, model: str, pl: int) -> dict:
    cmd = [*ggrun_exe(), "bench", "--batched", "-m", model, *common_args(a, pl), "-o", "jsonl"]
    if a.cold:
        cmd.append("--no-warmup")
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TERM="dumb"))
    if out.returncode != 0:
        raise SystemExit(f"ggrun failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return _last_record(out.stdout)


def run_llama(a, llama: Path, model: str, pl: int) -> dict:
    cmd = [str(llama / "llama-batched-bench"), "-m", model, *common_args(a, pl), "-fa", "on",
           "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return _last_record(out.stdout + "\n" + out.stderr)


def _last_record(text: str) -> dict:
    """The last JSON object line of a tool's output (llama.cpp logs around its records)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            return json.loads(line)
    raise SystemExit(f"no jsonl record in the output:\n{text[-2000:]}")


def cpu_flags() -> str:
    """The CPU's model name and its vector flags (what the kernels of both tools can use)."""
    name, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "fma", "f16c", "amx", "sse4"))]
    except OSError:
        pass
    return f"{name}; {' '.join(flags)}"


def gpu_name() -> str:
    """The GPUs nvidia-smi names (for -ngl > 0 runs), or a note that it could not say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"
    return ", ".join(x.strip() for x in out.stdout.splitlines() if x.strip()) or "unknown"


def compare(a, model: str, llama: Path, have_llama: bool) -> float | None:
    """One model's table, B by B; the lowest S_TG ratio (None without llama.cpp)."""
    print(f"{Path(model).name}: -npp {a.npp} -ntg {a.ntg} -t {a.threads or 'default'} -ngl {a.n_gpu_layers}"
          f"{' -pps' if a.pps else ''}", flush=True)
    print(f"{'B':>4} | {'ggrun S_PP':>10} {'llama S_PP':>10} {'ratio':>6} | {'ggrun S_TG':>10} {'llama S_TG':>10} "
          f"{'ratio':>6} | S_TG ratio per round", flush=True)
    lowest = None
    run_ggrun(a, model, 1)  # untimed: kernels compiled since the last run (an edited source) are not timed
    for pl in (int(x) for x in a.npl.split(",")):
        g, l = [], []
        for r in range(a.rounds):  # alternate which tool goes first, so neither always meets a warm machine
            for who in ("gl" if r % 2 == 0 else "lg"):
                if who == "g":
                    g.append(run_ggrun(a, model, pl))
                elif have_llama:
                    l.append(run_llama(a, llama, model, pl))
        gp, gt = (statistics.median(x[k] for x in g) for k in ("speed_pp", "speed_tg"))
        if l:
            lp, lt = (statistics.median(x[k] for x in l) for k in ("speed_pp", "speed_tg"))
            rounds = " ".join(f"{x['speed_tg'] / y['speed_tg']:.2f}" for x, y in zip(g, l))
            print(f"{pl:4d} | {gp:10.2f} {lp:10.2f} {gp / lp:5.2f}x | {gt:10.2f} {lt:10.2f} {gt / lt:5.2f}x | {rounds}",
                  flush=True)
            lowest = gt / lt if lowest is None else min(lowest, gt / lt)
        else:
            print(f"{pl:4d} | {gp:10.2f} {'-':>10} {'-':>6} | {gt:10.2f} {'-':>10} {'-':>6} |", flush=True)
    return lowest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2,gemma3-270m", help="comma list of GGUF files or known names")
    ap.add_argument("-npp", type=int, default=128)
    ap.add_argument("-ntg", type=int, default=128)
    ap.add_argument("-npl", default="1,2,4,8,16", help="comma list of sequence counts")
    ap.add_argument("-pps", action="store_true")
    ap.add_argument("-b", "--batch-size", type=int, default=2048)
    ap.add_argument("-ub", "--ubatch-size", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per B (medians are printed)")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR)))
    ap.add_argument("--target", type=float, default=1.2, help="the S_TG ratio every B should reach")
    ap.add_argument("--cold", action="store_true", help="ggrun's rows without their untimed warm-up run "
                    "(--no-warmup: each row's first run builds and captures its graphs while timed)")
    a = ap.parse_args()
    a.ctx_for = lambda pl: (a.npp + pl * a.ntg) if a.pps else pl * (a.npp + a.ntg)
    llama = Path(a.llama_bin)
    have_llama = (llama / "llama-batched-bench").exists()
    print(f"CPU: {cpu_flags()}{f'; GPU: {gpu_name()}' if a.n_gpu_layers else ''}", flush=True)
    if not have_llama:
        print(f"llama-batched-bench is not in {llama} (build it with `bash /work/shared/tools/cpu_anchor.sh`); "
              "ggrun's column only", flush=True)
    lowest = {}
    for name in a.model.split(","):
        model = resolve(name)
        lowest[Path(model).name] = compare(a, model, llama, have_llama)
    for name, r in lowest.items():
        if r is not None:
            print(f"{name}: lowest S_TG ratio {r:.2f}x ({'meets' if r >= a.target else 'below'} {a.target}x)",
                  flush=True)


if __name__ == "__main__":
    main()
