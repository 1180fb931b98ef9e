#!/usr/bin/env python3
"""Fuzz ggrun with corrupted copies of a real GGUF model: N variants (default 1,000), each one field
corrupted by loaders/gguf_mutations.py (families taken in turn: header fields, metadata types, lengths and
values, tensor dims, types, offsets and names, truncations, same-size tensor retypes, tensor-data flips),
each run through `ggrun run` and `ggrun measure` in a process of its own under a memory limit and a
timeout. Prints a table of outcomes per family and command, then the verdict:

- every variant of a family that breaks the file must exit 2 with one `error:` line of at most 300
  characters (`exit 2`); flips inside tensor data (and same-size retypes) may also run (`ran`) or stop
  on non-finite logits with its message (`non-finite`, exit 1);
- no variant may end in a traceback, a timeout or a kill (memory limit, signal).

Variants are written one per worker into a temporary folder in /tmp, removed at the end; the exit
status is 1 when the verdict fails.

    nice -n 19 .venv/bin/python scripts/tools/fuzz_gguf.py -m ~/.cache/ggrun/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ggrun.loaders.gguf_mutations import FAMILIES, MAY_RUN, Mutation, variants

ROOT = Path(__file__).resolve().parents[2]

# The limit is set by the child itself (a preexec_fn in a threaded parent can deadlock).
ENTRY = [sys.executable, "-c", "import os, resource; n = int(os.environ['FUZZ_MEM_BYTES']); "
         "resource.setrlimit(resource.RLIMIT_AS, (n, n)); from ggrun.cli.app import main; main()"]
COMMANDS = {
    "run": ["run", "-no-cnv", "-p", "Once upon a time", "-n", "4", "-c", "64", "--temp", "0", "-t", "1"],
    "measure": ["measure", "-c", "64", "-o", "json"],
}
OUTCOMES = ("exit 2", "ran", "non-finite", "exit 2, bad line", "other exit", "traceback", "timeout", "killed")
MAX_LINE = 300


@dataclass
class Result:
    index: int
    mutation: Mutation
    command: str
    outcome: str
    detail: str  # the error line, or why the outcome is what it is
    seconds: float


def classify(code: int | None, err: str, timed_out: bool, path: Path) -> tuple[str, str]:
    """An outcome of OUTCOMES, and the line that shows it. A clean rejection is one `error:` line of at
    most MAX_LINE characters that names the file."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("ggrun: ")]
    last = lines[-1] if lines else ""
    if timed_out:
        return "timeout", last
    if code is None or code < 0:
        return "killed", f"signal {-code}" if code else last
    if "Traceback (most recent call last)" in err:
        return "traceback", last
    if code == 0:
        return "ran", ""
    one_line = len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) <= MAX_LINE
    if code == 2:
        one_line = one_line and str(path) in lines[0]
        return ("exit 2" if one_line else "exit 2, bad line"), last if one_line else f"{len(lines)} lines: {err[-400:]!r}"
    if code == 1 and one_line and "non-finite logits" in lines[0]:
        return "non-finite", last
    return "other exit", f"exit {code}: {last}"


def run_one(variant: Path, command: str, timeout: float, mem_bytes: int) -> tuple[int | None, str, bool, float]:
    """Run one command on a variant in its own process group: (exit code, stderr, timed out, seconds)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "FUZZ_MEM_BYTES": str(mem_bytes)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([*ENTRY, *COMMANDS[command][:1], "-m", str(variant), *COMMANDS[command][1:]],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        timed_out = True
    return proc.returncode, err.decode("utf-8", "replace"), timed_out, time.perf_counter() - t0


def expected(family: str, command: str, outcome: str) -> bool:
    """Whether an outcome is allowed for a family: a corrupt structure or value is rejected; a data flip
    or a same-size retype reads bytes no reader can check, so it may also run or stop on non-finite logits."""
    if family not in MAY_RUN:
        return outcome == "exit 2"
    return outcome in ("ran", "non-finite", "exit 2")


def table(results: list[Result], command: str) -> str:
    counts: dict[str, collections.Counter] = {f: collections.Counter() for f in FAMILIES}
    for r in results:
        if r.command == command:
            counts[r.mutation.family][r.outcome] += 1
    cols = ["family", "variants", *OUTCOMES]
    rows = []
    total = collections.Counter()
    for family in FAMILIES:
        c = counts[family]
        if not sum(c.values()):
            continue
        total.update(c)
        rows.append([family, str(sum(c.values())), *(str(c[o]) for o in OUTCOMES)])
    rows.append(["total", str(sum(total.values())), *(str(total[o]) for o in OUTCOMES)])
    widths = [max(len(col), *(len(r[i]) for r in rows)) for i, col in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                          for i, (v, w) in enumerate(zip(vals, widths))) + " |"
    sep = "| " + " | ".join("-" * w if i == 0 else "-" * (w - 1) + ":" for i, w in enumerate(widths)) + " |"
    return "\n".join([f"`ggrun {command}`:", "", line(cols), sep, *map(line, rows)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-m", "--model", required=True, help="the GGUF file to corrupt (it is only read)")
    ap.add_argument("-n", "--variants", type=int, default=1000, help="variants to make (default 1000)")
    ap.add_argument("-s", "--seed", type=int, default=0, help="seed of the mutations (default 0)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="variants checked at once (default 2)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per command (default 120)")
    ap.add_argument("--mem-gib", type=float, default=4.0, help="address-space limit per command (default 4 GiB)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma list of families (default: all)")
    ap.add_argument("--commands", default="run,measure", help="run, measure or both (default)")
    ap.add_argument("--examples", type=int, default=3, help="unexpected outcomes shown per family and command")
    args = ap.parse_args()
    src = Path(args.model).expanduser()
    families = tuple(f for f in args.families.split(",") if f)
    unknown = set(families) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    commands = [c for c in args.commands.split(",") if c]
    mem = int(args.mem_gib * 2**30)

    # the untouched model must run cleanly first (and compiles the CPU kernels if this is the first run)
    for command in commands:
        code, err, timed_out, secs = run_one(src, command, max(args.timeout, 900), mem)
        outcome, detail = classify(code, err, timed_out, src)
        if outcome != "ran":
            print(f"the unmodified model does not run cleanly under `{command}`: {outcome}: {detail}", file=sys.stderr)
            return 2
        print(f"baseline `ggrun {command}` on {src.name}: {secs:.1f} s", file=sys.stderr)

    mutations = variants(src, args.variants, args.seed, families)
    results: list[Result] = []
    lock = threading.Lock()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ggrun-fuzz-", dir="/tmp") as tmp:
        free = [Path(tmp) / f"variant-{j}.gguf" for j in range(args.jobs)]
        finished = [0]

        def check(i: int) -> None:
            with lock:
                path = free.pop()
            try:
                m = mutations[i]
                m.apply_file(src, path)
                for command in commands:
                    code, err, timed_out, secs = run_one(path, command, args.timeout, mem)
                    outcome, detail = classify(code, err, timed_out, path)
                    with lock:
                        results.append(Result(i, m, command, outcome, detail, secs))
            finally:
                path.unlink(missing_ok=True)
                with lock:
                    free.append(path)
                    finished[0] += 1
                    if finished[0] % 50 == 0:
                        bad = sum(not expected(r.mutation.family, r.command, r.outcome) for r in results)
                        print(f"{finished[0]}/{len(mutations)} variants, {bad} unexpected outcomes, "
                              f"{time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(check, range(len(mutations))))

    results.sort(key=lambda r: (r.index, r.command))
    elapsed = time.perf_counter() - t_start
    print(f"ggrun GGUF fuzz: {src.name}, {len(mutations)} variants (seed {args.seed}), "
          f"limits {args.mem_gib:g} GiB address space and {args.timeout:g} s per command, {elapsed / 60:.1f} min\n")
    for command in commands:
        print(table(results, command) + "\n")

    unexpected = [r for r in results if not expected(r.mutation.family, r.command, r.outcome)]
    crashes = collections.Counter(r.outcome for r in results if r.outcome in ("traceback", "timeout", "killed"))
    longest = max((len(r.detail) for r in results if r.outcome == "exit 2"), default=0)
    print(f"tracebacks {crashes['traceback']}, timeouts {crashes['timeout']}, killed {crashes['killed']}; "
          f"unexpected outcomes {len(unexpected)}; longest error line {longest} characters")
    shown: collections.Counter = collections.Counter()
    for r in unexpected:
        key = (r.mutation.family, r.command)
        if shown[key] < args.examples:
            shown[key] += 1
            print(f"  #{r.index} {r.command} {r.mutation.family} ({r.mutation.target}): {r.outcome}: {r.detail[:400]}")
    print("verdict: " + ("pass" if not unexpected else "FAIL"))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
