#!/usr/bin/env python3
"""Every architecture ggrun runs against llama.cpp, on tiny synthetic models (tests/synth.py's FAMILY_PRESETS:
random weights scaled so that next-token distributions are peaked): llama-perplexity scores
tests/data/ppl_prose.txt and saves its log-probabilities (--kl-divergence-base), then `ggrun perplexity
--kl-divergence` scores the same tokens against them. The table gives, per family and weight type, the mean
KL divergence, how often both rank the same token first, and both perplexities (acceptance: mean KLD <= 0.005
and same top >= 98%).

`--save-data` also writes llama.cpp's top token and log-probabilities at every scored position
(tests/data/families_llama_cpp.json), which tests/llm/test_families.py checks ggrun against without llama.cpp.

llama.cpp's tools come from `bash ../shared/tools/cpu_anchor.sh` (pass its directory with --llama-bin or
$LLAMA_BIN).

    .venv/bin/python scripts/arch_vs_llama.py                       # every family, F32, F16 and Q4_K
    .venv/bin/python scripts/arch_vs_llama.py --families qwen3 gemma2 --types F32 --save-data
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf.constants import GGMLQuantizationType as QT  # noqa: E402

from ggrun.core.llm.kl_divergence import LogProbReader, dequantize_log_probs  # noqa: E402
from tests.synth import FAMILY_PRESETS, write_tiny_family  # noqa: E402

DEFAULT_ANCHOR = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
TEXT = ROOT / "tests" / "data" / "ppl_prose.txt"
DATA = ROOT / "tests" / "data" / "families_llama_cpp.json"
N_CTX = 128
SAVED_CHUNKS = 2  # chunks of llama.cpp's log-probabilities kept in the test data (63 positions each)


def ggrun_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("ggrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ggrun.cli.app"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc


def compare(bin_dir: Path, model: Path, base: Path, chunks: int, threads: int) -> dict:
    """llama-perplexity's log-probabilities saved to `base`, then ggrun's KL divergence against them."""
    run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(TEXT), "-c", str(N_CTX), "--chunks",
         str(chunks), "-t", str(threads), "--kl-divergence-base", str(base)])
    proc = run([*ggrun_cmd(), "perplexity", "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence",
                "-t", str(threads), "-o", "json"])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def saved_positions(base: Path, n_chunks: int) -> dict:
    """llama.cpp's tokens and, per scored position of the first n_chunks chunks, its top token, that token's
    log-probability and the next token's (from the base file, quantized as llama.cpp saves them)."""
    r = LogProbReader(base)
    try:
        top, top_lp, next_lp = [], [], []
        for i in range(n_chunks):
            lp = dequantize_log_probs(r.chunk(i), r.n_vocab)
            nxt = r.tokens[i * r.n_ctx + r.n_ctx // 2 + 1:(i + 1) * r.n_ctx]
            rows = np.arange(len(nxt))
            top += lp.argmax(axis=1).tolist()
            top_lp += np.round(lp.max(axis=1), 4).tolist()
            next_lp += np.round(lp[rows, nxt], 4).tolist()
        return {"n_ctx": r.n_ctx, "tokens": r.tokens[:n_chunks * r.n_ctx].tolist(), "top": top, "top_logprob": top_lp,
                "next_logprob": next_lp}
    finally:
        r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR)))
    ap.add_argument("--families", nargs="+", default=list(FAMILY_PRESETS))
    ap.add_argument("--types", nargs="+", default=["F32", "F16", "Q4_K"])
    ap.add_argument("--chunks", type=int, default=8, help="chunks of -c 128 scored (63 positions each)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--save-data", action="store_true", help=f"write llama.cpp's results to {DATA.relative_to(ROOT)}")
    a = ap.parse_args()
    bin_dir = Path(a.llama_bin)
    if not (bin_dir / "llama-perplexity").exists():
        raise SystemExit(f"no llama-perplexity in {bin_dir} (bash ../shared/tools/cpu_anchor.sh builds it)")
    data = json.loads(DATA.read_text()) if a.save_data and DATA.exists() else {}
    print(f"{'family':8} {'type':5} {'mean KLD':>10} {'same top':>9} {'PPL llama.cpp':>14} {'PPL ggrun':>10}  ok")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for fam in a.families:
            for type_name in a.types:
                model = write_tiny_family(Path(tmp) / f"{fam}-{type_name}.gguf", fam, weight_type=QT[type_name],
                                          **FAMILY_PRESETS[fam])
                base = Path(tmp) / f"{fam}-{type_name}.kld"
                rec = compare(bin_dir, model, base, a.chunks, a.threads)
                kld, same = rec["kld"][0], rec["same_top_p"][0]
                ok = kld <= 0.005 and same >= 0.98
                failed += not ok
                print(f"{fam:8} {type_name:5} {kld:10.6f} {same:9.2%} {rec['ppl_base'][0]:14.4f} "
                      f"{rec['ppl'][0]:10.4f}  {'yes' if ok else 'NO'}", flush=True)
                if a.save_data:
                    data[f"{fam}/{type_name}"] = saved_positions(base, min(SAVED_CHUNKS, a.chunks))
    if a.save_data:
        DATA.write_text(json.dumps({"producer": "llama-perplexity (llama.cpp via llama-cpp-python 0.3.36), "
                                                "scripts/arch_vs_llama.py", "models": "tests/synth.py FAMILY_PRESETS",
                                    **{k: v for k, v in sorted(data.items()) if "/" in k}}) + "\n")
        print(f"wrote {DATA.relative_to(ROOT)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
