#!/usr/bin/env python3
"""How often a GPU ranks the same token first as llama.cpp's CPU does, on the tiny families' quantized models
(loaders/synthetic.py's FAMILY_PRESETS, the types tests/data/families_llama_cpp.json holds): ggrun's CUDA backend
and llama.cpp's own CUDA build, each with every layer offloaded, scored against the same saved CPU
log-probabilities.
Issue 32 asks the GPU to agree with the CPU at 98% of positions; this says what llama.cpp's GPU reaches on the same
files, where 8-bit activation rounding (per 32 values on a GPU, per 256 for the k-quants on a CPU) moves top tokens.

Two steps, the second on the GPU machine:

    python3 scripts/bench/gpu_agreement.py prepare DIR    # the models, and llama-perplexity's CPU
                                                           # --kl-divergence-base files (cpu_anchor.sh's tools)
    python3 scripts/bench/gpu_agreement.py compare DIR    # ggrun -ngl 99 and llama-perplexity -ngl 99 ($LLB:
                                                           # cuda_anchor.sh's build, plus `ninja llama-perplexity`)
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from arch_vs_llama import DATA, DEFAULT_ANCHOR, N_CTX, TEXT  # this folder, beside this script
from gguf.constants import GGMLQuantizationType as QT
from ppl_vs_llama import ggrun_cmd, run

from ggrun.loaders.synthetic import family_options, write_tiny_family

CHUNKS = 8  # chunks of N_CTX tokens: 504 scored positions


def cases() -> list[str]:
    """family/type of every quantized model llama.cpp's saved results cover."""
    return sorted(k for k in json.loads(DATA.read_text()) if "/" in k and k.split("/")[1] not in ("F32", "F16"))


def prepare(out: Path, bin_dir: Path, threads: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for case in cases():
        name, type_name = case.split("/")
        arch, options = family_options(name, QT[type_name])
        model = write_tiny_family(out / f"{name}-{type_name}.gguf", arch, weight_type=QT[type_name], **options)
        run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(TEXT), "-c", str(N_CTX), "--chunks",
             str(CHUNKS), "-t", str(threads), "--kl-divergence-base", str(model.with_suffix(".kld"))])
        print(f"{case}: {model.name} and its CPU base", flush=True)


def llama_gpu(bin_dir: Path, model: Path) -> tuple[float, float]:
    """llama-perplexity's mean KLD and same-top share, every layer on the GPU, against the model's CPU base."""
    text = run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-ngl", "99", "-c", str(N_CTX),
                "--kl-divergence-base", str(model.with_suffix(".kld")), "--kl-divergence"]).stdout
    kld = re.search(r"^Mean\s+KLD:\s+([0-9.]+)", text, re.M)
    same = re.search(r"^Same top p:\s+([0-9.]+)", text, re.M)
    if kld is None or same is None:
        raise SystemExit(f"no KLD figures from llama-perplexity for {model.name}:\n{text[-2000:]}")
    return float(kld.group(1)), float(same.group(1)) / 100


def ggrun_gpu(model: Path) -> tuple[float, float]:
    """ggrun perplexity's mean KLD and same-top share, every layer on GPU 0, against the model's CPU base."""
    rec = json.loads(run([*ggrun_cmd(), "perplexity", "-m", str(model), "-ngl", "99", "-c", str(N_CTX),
                          "--kl-divergence-base", str(model.with_suffix(".kld")), "--kl-divergence", "-o", "json"])
                     .stdout.strip().splitlines()[-1])
    return rec["kld"][0], rec["same_top_p"][0]


def compare(out: Path, bin_dir: Path) -> None:
    print(f"{'case':16s} {'ggrun GPU: KLD':>15s} {'same top':>9s} {'llama.cpp GPU: KLD':>19s} {'same top':>9s}")
    for case in cases():
        model = out / f"{case.replace('/', '-')}.gguf"
        (gk, gs), (lk, ls) = ggrun_gpu(model), llama_gpu(bin_dir, model)
        print(f"{case:16s} {gk:15.5f} {gs:9.1%} {lk:19.5f} {ls:9.1%}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("prepare", "compare"))
    ap.add_argument("dir", type=Path, help="where the models and their CPU bases are")
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp's tools (prepare: the CPU build, $LLAMA_BIN or "
                                                   "cpu_anchor.sh's; compare: the CUDA build, $LLB)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    if a.step == "prepare":
        prepare(a.dir, a.llama_bin or Path(os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR))), a.threads)
    else:
        compare(a.dir, a.llama_bin or Path(os.environ.get("LLB", "/tmp/llama-cuda/llama.cpp/build/bin")))


if __name__ == "__main__":
    main()
