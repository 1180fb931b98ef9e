"""Continuous batching against one sequence at a time, measured in one run: the same sequences
(`ggrun parallel`'s system prompt and questions) served by -np clients sharing each decode, then by a
single client, with the same model, context and sampling; prints both speeds and their ratio.

With --batched, `ggrun parallel` against `ggrun bench --batched` at B = -np (-npp 128 -ntg 128), alternating over
--rounds: the generated t/s of the run against S_TG, issue 31's bar on the GPU (0.8x at -np 64, -ns 256, -n 128,
-c 32768, -ngl 99; parallel with its own sampling defaults unless --temp is given); with --llama-bin holding
llama-parallel, that tool's run with the same options is timed beside them, for its own figure.

With --llama, `ggrun parallel` against llama.cpp's `llama-parallel` instead: the same command line for
both (-np, -ns, -n, -c, -t, -s, --temp), each as its own process, alternating over --rounds, for every
-np of a comma list and every model of a comma list (default SmolLM2 and gemma-3-270m); prints each tool's
generated t/s (its summary's "Total gen tokens" speed), the ratio of the medians and each round's, then per
model the lowest ratio against --target (issue 31's CPU bar: 1.5x at every -np). llama.cpp's tools come from `bash /work/shared/tools/cpu_anchor.sh` (--llama-bin
or $LLAMA_BIN).

Usage: python scripts/bench/bench_parallel.py [-m MODEL] [-np 4] [-ns 16] [-n 64] [-c 4096] [--temp 0] [-t THREADS]
       python scripts/bench/bench_parallel.py --batched -m MODEL -ngl 99 -np 64 -ns 256 -n 128 -c 32768
                                        [--rounds 2] [--target 0.8] [--llama-bin DIR]
       python scripts/bench/bench_parallel.py --llama [-m smollm2,gemma3-270m] [-np 1,4,8] [-ns 16] [-n 64] [-t 2]
                                        [--rounds 2] [--target 1.5]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ggrun.cli.parallel_prompts import QUESTIONS, SYSTEM_PROMPT, format_turn
from ggrun.core.backends.cpu import set_threads
from ggrun.core.backends.cpu.threads import WAIT_VARIABLES
from ggrun.core.backends.registry import usable_backends
from ggrun.core.llm.model import Model
from ggrun.core.llm.parallel import ParallelRunner, ParallelSummary, SequenceResult
from ggrun.core.llm.sampling import SamplingParams
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.download import resolve_model


def serve(model: Model, n_clients: int, system: list[int], jobs: list[tuple[str, list[int]]], n_predict: int,
          n_ctx: int, n_batch: int, sampling: SamplingParams) -> tuple[ParallelSummary, dict[int, SequenceResult]]:
    session = Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_clients + 1))
    runner = ParallelRunner(session, n_clients, n_predict, sampling, n_batch)
    results: dict[int, SequenceResult] = {}
    summary = runner.run(system, jobs, lambda r: results.__setitem__(r.seq, r))
    return summary, results


def line(name: str, s: ParallelSummary) -> str:
    return (f"{name:>14s}: {s.total_s:7.1f} s  prompt {s.n_prompt:5d} t {s.prompt_tps:8.2f} t/s  "
            f"gen {s.n_gen:5d} t {s.gen_tps:7.2f} t/s  total {s.total_tps:7.2f} t/s  "
            f"cache misses {s.cache_misses}  graphs reused {s.graphs_reused}")


DEFAULT_ANCHOR = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
GEN_SPEED = re.compile(r"Total gen tokens:\s*(\d+), speed:\s*([\d.]+) t/s")


def gen_speed(cmd: list[str]) -> tuple[int, float]:
    """(generated tokens, their t/s) from a parallel tool's summary, on stdout or stderr. Each tool waits
    as its own defaults say: not with the OpenMP settings ggrun's import put into this process's environment."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, TERM="dumb"))
    m = GEN_SPEED.search(out.stdout + out.stderr)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{(out.stdout + out.stderr)[-2000:]}")
    return int(m.group(1)), float(m.group(2))


def against_llama(a, model: str, n_parallel: list[int]) -> float:
    """ggrun parallel and llama-parallel alternating with one command line; medians of generated t/s; the
    lowest ratio of the medians."""
    llama = Path(a.llama_bin) / "llama-parallel"
    if not llama.exists():
        raise SystemExit(f"{llama} is missing: build it with `bash /work/shared/tools/cpu_anchor.sh`")
    model = model if Path(model).is_file() else str(resolve_model(model))
    lowest = float("inf")
    ggrun = Path(__file__).resolve().parents[2] / ".venv/bin/ggrun"
    warm = ["-m", model, "-np", "1", "-ns", "1", "-n", "4", "-c", str(a.ctx_size)]
    # untimed: kernels compiled since the last run (an edited source) are not timed
    gen_speed([str(ggrun), "parallel", *warm] + (["-t", str(a.threads)] if a.threads else []))
    print(f"{Path(model).name}: -ns {a.sequences} -n {a.n_predict} -c {a.ctx_size} --temp {a.temp} -s {a.seed} "
          f"-t {a.threads or 'default'}", flush=True)
    for np_ in n_parallel:
        args = ["-m", model, "-np", str(np_), "-ns", str(a.sequences), "-n", str(a.n_predict), "-c", str(a.ctx_size),
                "--temp", str(a.temp), "-s", str(a.seed)] + (["-t", str(a.threads)] if a.threads else [])
        speeds: dict[str, list[float]] = {"ggrun": [], "llama": []}
        tokens: dict[str, set[int]] = {"ggrun": set(), "llama": set()}
        for r in range(a.rounds):
            for who in (("ggrun", "llama") if r % 2 == 0 else ("llama", "ggrun")):
                cmd = [str(ggrun), "parallel", *args] if who == "ggrun" else [str(llama), *args]
                n, speed = gen_speed(cmd)
                speeds[who].append(speed)
                tokens[who].add(n)
        g, ll = statistics.median(speeds["ggrun"]), statistics.median(speeds["llama"])
        rounds = " ".join(f"{x / y:.2f}" for x, y in zip(speeds["ggrun"], speeds["llama"]))
        # the speeds are generated tokens over the whole run: where the responses' lengths differ (near-ties of
        # greedy decoding reach a stop text sooner or later), the tool generating more also reads its prompts
        # for more generated tokens
        counts = f"generated tokens ggrun {sorted(tokens['ggrun'])}, llama {sorted(tokens['llama'])}"
        print(f"-np {np_:3d}: ggrun {g:7.2f} t/s {speeds['ggrun']}, llama-parallel {ll:7.2f} t/s {speeds['llama']}, "
              f"ratio {g / ll:.2f}x (rounds {rounds}; {counts})", flush=True)
        lowest = min(lowest, g / ll)
    return lowest


def batched_speed(cmd: list[str]) -> float:
    """S_TG of `ggrun bench --batched -o jsonl`'s one row."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or len(rows) != 1:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{(out.stdout + out.stderr)[-2000:]}")
    return float(rows[0]["speed_tg"])


def against_batched(a) -> float:
    """ggrun parallel's generated t/s against ggrun bench --batched's S_TG at B = -np, alternating; the ratio of
    the medians. llama-parallel's run beside them where --llama-bin has it."""
    model = a.model if Path(a.model).is_file() else str(resolve_model(a.model))
    ggrun = [sys.executable, "-c", "from ggrun.cli.app import main; main()"]
    common = ["-m", model, "-ngl", str(a.gpu_layers), "-c", str(a.ctx_size)]
    run = common + ["-np", a.parallel, "-ns", str(a.sequences), "-n", str(a.n_predict)]
    run += ["--temp", str(a.temp), "-s", str(a.seed)] if a.temp is not None else []
    bench = ggrun + ["bench", "--batched", *common, "-npp", "128", "-ntg", "128", "-npl", a.parallel, "-o", "jsonl"]
    llama = Path(a.llama_bin) / "llama-parallel"
    speeds: dict[str, list[float]] = {"parallel": [], "batched": [], "llama-parallel": []}
    gen_speed(ggrun + ["parallel", *common, "-np", "1", "-ns", "1", "-n", "4"])  # untimed: kernels compiled
    for r in range(a.rounds):
        for who in (("parallel", "batched") if r % 2 == 0 else ("batched", "parallel")):
            speeds[who].append(gen_speed(ggrun + ["parallel", *run])[1] if who == "parallel" else batched_speed(bench))
        if llama.exists():
            try:
                speeds["llama-parallel"].append(gen_speed([str(llama), *run])[1])
            except SystemExit as err:  # e.g. its cache cannot hold every client's whole prompt (no sharing)
                print(f"llama-parallel: {str(err).splitlines()[-1][-200:]}", flush=True)
                llama = Path("/nonexistent")
    g, b = statistics.median(speeds["parallel"]), statistics.median(speeds["batched"])
    rounds = " ".join(f"{x / y:.2f}" for x, y in zip(speeds["parallel"], speeds["batched"]))
    print(f"-np {a.parallel}: parallel {g:.0f} gen t/s {speeds['parallel']}, bench --batched S_TG {b:.0f} "
          f"{speeds['batched']}: {g / b:.2f}x (rounds {rounds})", flush=True)
    if speeds["llama-parallel"]:
        ll = statistics.median(speeds["llama-parallel"])
        print(f"llama-parallel, same options: {ll:.0f} gen t/s {speeds['llama-parallel']}; ggrun parallel / "
              f"llama-parallel {g / ll:.2f}x", flush=True)
    return g / b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None,
                    help="GGUF file or known model name (default smollm2; --llama: a comma list, default "
                         "smollm2,gemma3-270m)")
    ap.add_argument("-np", "--parallel", default=None,
                    help="clients of the batched run (default 4; --llama: a comma list, default 1,4,8)")
    ap.add_argument("--llama", action="store_true", help="ggrun parallel against llama-parallel")
    ap.add_argument("--batched", action="store_true", help="ggrun parallel against ggrun bench --batched's S_TG")
    ap.add_argument("-ngl", "--gpu-layers", type=int, default=0, help="--batched: layers offloaded")
    ap.add_argument("--rounds", type=int, default=2, help="--llama: alternating rounds per -np")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR)))
    ap.add_argument("-ns", "--sequences", type=int, default=16)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-b", "--batch-size", type=int, default=512)
    ap.add_argument("--temp", type=float, default=None, help="default 0 (--batched: parallel's own default)")
    ap.add_argument("-s", "--seed", type=int, default=1)
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for matrix products")
    ap.add_argument("--target", type=float, default=None,
                    help="the ratio to reach (--llama: every -np's, default 1.5; --batched: default 0.8)")
    a = ap.parse_args()
    if a.batched:
        a.model, a.parallel = a.model or "smollm2", a.parallel or "64"
        ratio, target = against_batched(a), a.target or 0.8
        print(f"parallel / batched S_TG {ratio:.2f}x ({'meets' if ratio >= target else 'below'} {target}x)")
        return
    a.target = a.target or 1.5
    a.temp = 0.0 if a.temp is None else a.temp
    if a.llama:
        lowest = {m: against_llama(a, m, [int(x) for x in (a.parallel or "1,4,8").split(",")])
                  for m in (a.model or "smollm2,gemma3-270m").split(",")}
        for m, r in lowest.items():
            print(f"{Path(m).name}: lowest generated t/s ratio {r:.2f}x ({'meets' if r >= a.target else 'below'} "
                  f"{a.target}x)", flush=True)
        return
    a.model = a.model or "smollm2"
    a.parallel = a.parallel or "4"
    a.parallel = int(a.parallel)

    set_threads(a.threads)
    model = Model.load(resolve_model(a.model), usable_backends())
    tok = model.tokenizer
    system = tok.tokenize(SYSTEM_PROMPT, add_special=True, parse_special=False)
    jobs = [(q, tok.tokenize(format_turn(q), add_special=False, parse_special=False))
            for q in (QUESTIONS[i % len(QUESTIONS)] for i in range(a.sequences))]
    sampling = SamplingParams(temp=a.temp, seed=a.seed)
    print(f"{Path(model.weights.source).name}: {a.sequences} sequences, -n {a.n_predict}, -c {a.ctx_size}, "
          f"--temp {a.temp}, system prompt {len(system)} tokens; backends "
          f"{', '.join(b.name for b in model.backends)}", flush=True)

    runs = {}
    for n_clients in (a.parallel, 1):
        t0 = time.perf_counter()
        runs[n_clients] = serve(model, n_clients, system, jobs, a.n_predict, a.ctx_size, a.batch_size, sampling)
        print(line(f"-np {n_clients}", runs[n_clients][0]) + f"  (wall {time.perf_counter() - t0:.1f} s)", flush=True)

    (par, par_res), (one, one_res) = runs[a.parallel], runs[1]
    same = sum(par_res[j].response_tokens == one_res[j].response_tokens for j in par_res)
    print(f"total speed: -np {a.parallel} {par.total_tps:.2f} t/s, -np 1 {one.total_tps:.2f} t/s, "
          f"ratio {par.total_tps / one.total_tps:.2f}x")
    print(f"generation speed ratio {par.gen_tps / one.gen_tps:.2f}x; "
          f"{same}/{len(par_res)} sequences with the same tokens in both runs")


if __name__ == "__main__":
    main()
