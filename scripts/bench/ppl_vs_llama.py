#!/usr/bin/env python3
"""ggrun perplexity against llama-perplexity on the same text, side by side: both tools score
tests/data/ppl_prose.txt (18 KB of English prose) at each -c, for each model, and the script prints both
final estimates and their ratio (acceptance: within 1%). `--detail` adds the running estimate after
every chunk, which shows where two runs part.

llama.cpp's tools come from `bash ../shared/tools/cpu_anchor.sh` (pass its directory with
--llama-bin or $LLAMA_BIN); without them only ggrun's column is printed.

    .venv/bin/python scripts/bench/ppl_vs_llama.py                         # SmolLM2 and gemma-3-270m, -c 256 and 512
    .venv/bin/python scripts/bench/ppl_vs_llama.py --models gemma3-270m -c 512 --detail --ggrun-arg=--numerics=f32
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from ggrun.loaders.download import KNOWN_MODELS, is_cached, model_path

DEFAULT_ANCHOR = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
TEXT = ROOT / "tests" / "data" / "ppl_prose.txt"


def ggrun_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("ggrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ggrun.cli.app"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return proc


def llama_ppl(bin_dir: Path, model: Path, text: Path, n_ctx: int, threads: int) -> tuple[float, list[float]]:
    """llama-perplexity's final estimate and its running estimate after each chunk."""
    proc = run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(n_ctx),
                "-t", str(threads)])
    both = proc.stdout + proc.stderr
    final = re.search(r"Final estimate: PPL = ([\d.]+)", both)
    if final is None:
        raise SystemExit(f"llama-perplexity printed no final estimate:\n{both[-2000:]}")
    return float(final.group(1)), [float(x) for x in re.findall(r"\[\d+\]([\d.]+),", both)]


def ggrun_ppl(model: Path, text: Path, n_ctx: int, threads: int, extra: list[str]) -> tuple[float, list[float]]:
    proc = run([*ggrun_cmd(), "perplexity", "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-t", str(threads),
                "-o", "json", *extra])
    rec = json.loads(proc.stdout)
    return float(rec["perplexity"]), [float(x) for x in rec["chunks"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"], help="known names or GGUF paths")
    ap.add_argument("-c", "--ctx", type=int, nargs="+", default=[256, 512], help="context sizes")
    ap.add_argument("-f", "--file", default=str(TEXT), help="the text to score")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--detail", action="store_true", help="also print the running estimate after each chunk")
    ap.add_argument("--ggrun-arg", action="append", default=[],
                    help="an extra option for ggrun, e.g. --ggrun-arg=--no-flash-attn (repeatable; OPT=VALUE "
                         "is split into two arguments)")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR)),
                    help="directory of llama.cpp's llama-perplexity")
    args = ap.parse_args()
    extra = [part for a in args.ggrun_arg for part in a.split("=", 1)]
    llama = Path(args.llama_bin)
    have_llama = (llama / "llama-perplexity").is_file()
    if not have_llama:
        print(f"llama-perplexity is not in {llama} (build it with `bash ../shared/tools/cpu_anchor.sh`); "
              "only ggrun is measured")
    text = Path(args.file)
    print(f"text: {text.name} ({text.stat().st_size:,} bytes), -t {args.threads}"
          + (f", ggrun {' '.join(extra)}" if extra else ""))
    print(f"{'model':32s} {'-c':>5s} {'llama-perplexity':>17s} {'ggrun':>10s} {'ggrun/llama':>12s}")
    worst = 0.0
    for name in args.models:
        path = model_path(KNOWN_MODELS[name]) if name in KNOWN_MODELS else Path(name)
        if name in KNOWN_MODELS and not is_cached(KNOWN_MODELS[name]):
            print(f"{name}: not in the cache (ggrun models pull {name}); skipped")
            continue
        for n_ctx in args.ctx:
            ours, our_chunks = ggrun_ppl(path, text, n_ctx, args.threads, extra)
            ref, ref_chunks = llama_ppl(llama, path, text, n_ctx, args.threads) if have_llama else (None, [])
            ratio = ours / ref if ref else None
            if ratio is not None:
                worst = max(worst, abs(ratio - 1))
            print(f"{path.name:32s} {n_ctx:5d} {ref if ref else float('nan'):17.4f} {ours:10.4f} "
                  f"{ratio if ratio else float('nan'):12.4f}")
            if args.detail:
                for i, ours_i in enumerate(our_chunks):
                    ref_i = ref_chunks[i] if i < len(ref_chunks) else float("nan")
                    print(f"{'':32s} [{i + 1:2d}] {ref_i:17.4f} {ours_i:10.4f} {ours_i / ref_i:12.4f}")
    if have_llama:
        print(f"largest difference: {100 * worst:.2f}% ({'within' if worst <= 0.01 else 'beyond'} 1%)")


if __name__ == "__main__":
    main()
