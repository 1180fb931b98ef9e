#!/usr/bin/env python3
"""Every architecture ggrun runs against llama.cpp, on tiny synthetic models (tests/synth.py's FAMILY_PRESETS:
random weights scaled so that next-token distributions are peaked): llama-perplexity scores
tests/data/ppl_prose.txt and saves its log-probabilities (--kl-divergence-base), then `ggrun perplexity
--kl-divergence` scores the same tokens against them. The table gives, per family and weight type, the mean
KL divergence, how often both rank the same token first, and both perplexities (acceptance: mean KLD <= 0.005
and same top >= 98%).

`--speed qwen3-0.6b` instead measures speed side by side: a model of that family's real shape
(tests/synth.py SPEED_PRESETS, Q4_K blocks of random quants) under `llama-bench` and `ggrun bench`
alternating (pp512, tg128, -t 2 by default), with medians and the ratio.

`--save-data` also writes llama.cpp's top token and log-probabilities at every scored position
(tests/data/families_llama_cpp.json), which tests/llm/test_families.py checks ggrun against without llama.cpp.

llama.cpp's tools come from `bash ../shared/tools/cpu_anchor.sh` (pass its directory with --llama-bin or
$LLAMA_BIN).

    .venv/bin/python scripts/arch_vs_llama.py                       # every family, F32, F16 and Q4_K
    .venv/bin/python scripts/arch_vs_llama.py --families qwen3 gemma2 --types F32 --save-data
    .venv/bin/python scripts/arch_vs_llama.py --speed qwen3-0.6b --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf.constants import GGMLQuantizationType as QT  # noqa: E402

from ggrun.core.llm.kl_divergence import LogProbReader, dequantize_log_probs  # noqa: E402
from tests.synth import FAMILY_PRESETS, SPEED_PRESETS, write_random_family, write_tiny_family  # noqa: E402

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


def bench(cmd: list[str]) -> dict[str, float]:
    """t/s of pp and tg from a llama-bench-style JSON list (both tools write the same fields)."""
    out = run(cmd).stdout
    return {(f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"): float(r["avg_ts"])
            for r in json.loads(out[out.index("["):])}


def speed(bin_dir: Path, preset: str, rounds: int, threads: int) -> None:
    """llama-bench and ggrun bench alternating on a synthetic model of the preset's shape; medians, ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_family(Path(tmp) / f"{preset}-Q4_K.gguf", preset, QT.Q4_K)
        args = ["-m", str(model), "-p", "512", "-n", "128", "-t", str(threads), "-r", "1", "-o", "json"]
        ours: dict[str, list[float]] = {}
        theirs: dict[str, list[float]] = {}
        for _ in range(rounds):
            for k, v in bench([str(bin_dir / "llama-bench"), *args]).items():
                theirs.setdefault(k, []).append(v)
            for k, v in bench([*ggrun_cmd(), "bench", *args]).items():
                ours.setdefault(k, []).append(v)
    print(f"{preset} Q4_K (synthetic), -t {threads}, medians of {rounds} alternating rounds")
    print(f"{'test':6} {'llama.cpp t/s':>14} {'ggrun t/s':>10} {'ratio':>6}")
    for test in ("pp512", "tg128"):
        a, b = statistics.median(ours[test]), statistics.median(theirs[test])
        print(f"{test:6} {b:14.2f} {a:10.2f} {a / b:6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR)))
    ap.add_argument("--families", nargs="+", default=list(FAMILY_PRESETS))
    ap.add_argument("--types", nargs="+", default=["F32", "F16", "Q4_K"])
    ap.add_argument("--chunks", type=int, default=8, help="chunks of -c 128 scored (63 positions each)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--speed", choices=sorted(SPEED_PRESETS), help="measure speed on this preset instead")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the speed measurement")
    ap.add_argument("--save-data", action="store_true", help=f"write llama.cpp's results to {DATA.relative_to(ROOT)}")
    a = ap.parse_args()
    bin_dir = Path(a.llama_bin)
    if not (bin_dir / "llama-perplexity").exists():
        raise SystemExit(f"no llama-perplexity in {bin_dir} (bash ../shared/tools/cpu_anchor.sh builds it)")
    if a.speed:
        speed(bin_dir, a.speed, a.rounds, a.threads)
        return
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
