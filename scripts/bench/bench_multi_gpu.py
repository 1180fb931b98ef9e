#!/usr/bin/env python3
"""One model over two GPUs against one GPU, ggrun and llama.cpp's CUDA llama-bench side by side: a synthetic
model of a real shape (loaders/synthetic.py's write_synthetic; default llama-8b Q4_0), pp2048 and tg128 with every
layer offloaded, on one GPU (-sm none -mg 0), split by layers (-sm layer -ts 1,1: micro-batches pipelined
over the two) and split by rows (-sm row -ts 1,1). It prints each tool's t/s, each split's ratio to the
same tool on one GPU and to llama.cpp, and the issue's bars: with layers split, pp2048 at least 1.6x one
GPU and 1.5x llama.cpp's, tg128 within 10% of one GPU and at least 1.3x llama.cpp's; with rows split, tg128
at least llama.cpp's; and whether ggrun's greedy tokens with each split, with -dev CUDA1 and with
-sm none -mg 1 equal its tokens on GPU 0. With --gpus N (N > 2) the layer split covers N GPUs (its bar:
pp2048 at least 2.5x one GPU on four).

On a machine with two or more GPUs, with the anchor directory carried (`bash ../shared/tools/cuda_anchor.sh
prepare .anchor` here first; on the machine it builds llama-bench once, ~4 min):

    python3 scripts/bench/bench_multi_gpu.py --anchor .anchor [--rounds 2] [--model llama-8b:q4_0] [--gpus 2]

With fewer than two GPUs it says so and exits 0: there is nothing to split.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from ggrun.cli.bench_output import speeds_of

from ggrun.loaders.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[2]

SYNTH = Path("/tmp/synth")
LLAMA_BENCH = Path("/tmp/llama-cuda/llama.cpp/build/bin/llama-bench")
GGRUN = [sys.executable, "-c", "from ggrun.cli.app import main; main()"]
TESTS = ["-ngl", "99", "-p", "2048", "-n", "128", "-b", "2048", "-ub", "512", "-r", "3", "-o", "json"]
PROMPT = "The three most useful things to know about the ocean are"
PP_BAR, TG_BAR = 1.6, 0.9  # the acceptance: pipelined prompts 1.6x one GPU, generation within 10%
PP_VS_LLAMA, TG_VS_LLAMA = 1.5, 1.3  # ... and against llama.cpp's same split


def splits(n_gpus: int) -> list[tuple[str, list[str]]]:
    """(label, options for both tools' bench; llama-bench and ggrun bench both read '/' inside one -ts value)."""
    even = "/".join(["1"] * n_gpus)
    return [("1 GPU", ["-sm", "none", "-mg", "0"]),
            (f"layer {even}", ["-sm", "layer", "-ts", even]),
            (f"row {even}", ["-sm", "row", "-ts", even])]


# greedy runs only: the same tokens on the second GPU alone
OTHER_GPU = [("-dev CUDA1", ["-dev", "CUDA1"]), ("-sm none -mg 1", ["-sm", "none", "-mg", "1"])]


def gpu_count() -> int:
    """GPUs cupy sees (0 without cupy or a driver)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver: no GPU for this script
        return 0


def prepare(anchor: Path, model: str) -> Path:
    """llama-bench built (cuda_anchor.sh, which also writes and benches its smallest model once) and the model
    written by loaders/synthetic.py (whose presets include llama-70b)."""
    if not LLAMA_BENCH.exists():
        subprocess.run(["bash", str(anchor / "cuda_anchor.sh"), "device", "llama-135m:q4_0"], check=True,
                       stdout=subprocess.DEVNULL)
    preset, qtype = model.split(":")
    path = SYNTH / f"{preset}-{qtype}.gguf"
    if not path.exists():
        SYNTH.mkdir(parents=True, exist_ok=True)
        from gguf.constants import GGMLQuantizationType as QT

        write_synthetic(path, preset, QT[qtype.upper()])
    return path


def bench(tool: str, model: Path, split: list[str]) -> dict[str, float]:
    """{test: t/s} of one tool's bench with the split's options; {} (and the reason on stderr) where it fails,
    so that the other measurements still come (llama-bench refused -sm row on an H200 x4 machine)."""
    cmd = [str(LLAMA_BENCH)] if tool == "llama.cpp" else [*GGRUN, "bench"]
    res = subprocess.run([*cmd, "-m", str(model), *TESTS, *split], capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        print(f"{tool} bench {' '.join(split)} failed ({res.returncode}): {res.stderr.strip()[-600:]}",
              file=sys.stderr)
        return {}
    return speeds_of(res.stdout, tool)


def greedy_text(model: Path, split: list[str]) -> str:
    """ggrun's greedy continuation with the split's options (-ts as run spells it)."""
    opts = [o.replace("/", ",") for o in split]
    # -sp: a synthetic model's vocabulary is mostly control tokens, which print only so
    res = subprocess.run([*GGRUN, "run", "-m", str(model), "-p", PROMPT, "-n", "32", "--temp", "0", "-no-cnv", "-sp",
                          "-c", "512", "-ngl", "99", *opts], capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"ggrun run {' '.join(opts)} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    return res.stdout


def report(runs: dict, texts: dict[str, str], table: list[tuple[str, list[str]]]) -> None:
    """The table of medians, each split against the same tool on one GPU and against llama.cpp, and the bars."""
    med = {key: statistics.median(v) for key, v in runs.items()}
    missing = float("nan")  # a bench that failed: its ratios print as nan, its bars as not met
    print("| split | test | llama.cpp t/s | ggrun t/s | ggrun / llama.cpp | llama.cpp / its 1 GPU | ggrun / its 1 GPU |")
    print("|---|---|---|---|---|---|---|")
    for label, _ in table:
        for test in ("pp2048", "tg128"):
            lc, gg = med.get((label, test, "llama.cpp"), missing), med.get((label, test, "ggrun"), missing)
            lc1, gg1 = med.get(("1 GPU", test, "llama.cpp"), missing), med.get(("1 GPU", test, "ggrun"), missing)
            print(f"| {label} | {test} | {lc:,.1f} | {gg:,.1f} | {gg / lc:.3f} | {lc / lc1:.3f} | {gg / gg1:.3f} |")
    layer, row = table[1][0], table[2][0]

    def bar(what: str, got: float, want: float) -> None:
        print(f"{what}: {got:.2f}x (bar {want}x: {'met' if got >= want else 'NOT met'})")

    gg = {key[:2]: v for key, v in med.items() if key[2] == "ggrun"}
    lc = {key[:2]: v for key, v in med.items() if key[2] == "llama.cpp"}
    for label, _ in table:
        for test in ("pp2048", "tg128"):
            gg.setdefault((label, test), missing)
            lc.setdefault((label, test), missing)
    print()
    bar(f"ggrun -sm {layer} pp2048 / one GPU", gg[(layer, "pp2048")] / gg[("1 GPU", "pp2048")], PP_BAR)
    bar(f"ggrun -sm {layer} pp2048 / llama.cpp's", gg[(layer, "pp2048")] / lc[(layer, "pp2048")], PP_VS_LLAMA)
    bar(f"ggrun -sm {layer} tg128 / one GPU", gg[(layer, "tg128")] / gg[("1 GPU", "tg128")], TG_BAR)
    bar(f"ggrun -sm {layer} tg128 / llama.cpp's", gg[(layer, "tg128")] / lc[(layer, "tg128")], TG_VS_LLAMA)
    bar(f"ggrun -sm {row} tg128 / llama.cpp's", gg[(row, "tg128")] / lc[(row, "tg128")], 1.0)
    for label in texts:
        if label != "1 GPU":
            same = texts[label] == texts["1 GPU"]
            print(f"greedy tokens, {label} vs one GPU: {'equal' if same else 'DIFFER'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchor", type=Path, required=True, help="directory made by cuda_anchor.sh prepare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="llama-8b:q4_0", help="PRESET:TYPE for loaders/synthetic.py's write_synthetic")
    ap.add_argument("--gpus", type=int, default=2, help="GPUs the layer and row splits cover")
    a = ap.parse_args()
    n = gpu_count()
    if n < 2 or a.gpus > n:
        print(f"bench_multi_gpu: {n} GPU(s) here; splitting a model over {a.gpus} needs as many, so nothing is measured")
        return 0
    model = prepare(a.anchor, a.model)
    table = splits(a.gpus)
    texts = {label: greedy_text(model, split) for label, split in table + OTHER_GPU}
    for label, text in texts.items():
        print(f"greedy {label}: {text.strip()[:80]!r}", file=sys.stderr, flush=True)
    runs: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(a.rounds):  # the tools alternate per split and round
        for label, split in table:
            for tool in ("llama.cpp", "ggrun"):
                for test, ts in bench(tool, model, split).items():
                    runs.setdefault((label, test, tool), []).append(ts)
                    print(f"{label} {test} {tool}: {ts:.1f} t/s", file=sys.stderr, flush=True)
    report(runs, texts, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
