#!/usr/bin/env python3
"""What a first run costs: `ggrun run` on a machine whose kernel cache is empty, as `bash scripts/run.sh`
does after pip has installed the packages, then a second model type on the same cache, then each again.

Every run gets a GGRUN_CACHE of its own making (a temporary folder; the models are those of the usual
cache, linked in, so nothing is downloaded) and, the first time, an empty bytecode cache, as a fresh clone
has. Each run is timed as a user sees it: from just before the process starts to the first byte of
generated text on stdout, and to its exit. Its stderr lines are timestamped as they arrive, which splits
the time to the first token into
  start      interpreter start, imports, the model's file checked (before loading it),
  load       the model loaded (ggrun's `load time`),
  compile    the CPU kernels compiled (from the `compiling the CPU kernels` line to `kernels compiled`),
  prompt     the session made, the prompt evaluated and the first token sampled,
and the CPU time (user + system, of ggrun and the helper processes it compiles with) is given beside: on a
machine shared with other work, the wall times stretch with the load, the CPU time much less.

    .venv/bin/python scripts/bench/first_run.py                       # SmolLM2, then gemma-3-270m
    .venv/bin/python scripts/bench/first_run.py -m smollm2 -m gemma3-270m -t 2
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

KNOWN = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m": "gemma-3-270m-q4_k_m.gguf"}


@dataclass
class Run:
    first_token_s: float = 0.0
    total_s: float = 0.0
    compile_line_s: float | None = None  # when "compiling the CPU kernels" arrived
    compiled_line_s: float | None = None  # when "kernels compiled" arrived
    load_s: float = 0.0
    cpu_s: float = 0.0  # user + system seconds of the process and its helpers (all cores)
    stderr: list[str] = field(default_factory=list)

    def split(self) -> dict[str, float]:
        """start, load, compile and prompt: seconds that add up to the time to the first token."""
        before = self.compile_line_s if self.compile_line_s is not None else None
        compile_s = (self.compiled_line_s - self.compile_line_s) if before is not None else 0.0
        if before is None:  # nothing compiled: start and load run up to the session
            return {"start": max(0.0, self.first_token_s - self.load_s - self._after()), "load": self.load_s,
                    "compile": 0.0, "prompt": self._after()}
        return {"start": max(0.0, before - self.load_s), "load": self.load_s, "compile": compile_s,
                "prompt": self.first_token_s - self.compiled_line_s}

    def _after(self) -> float:
        """Without a compile line, the prompt's share is ggrun's prompt eval time."""
        for line in self.stderr:
            m = re.search(r"prompt eval time =\s*([\d.]+) ms", line)
            if m:
                return float(m.group(1)) / 1e3
        return 0.0


def run(cmd: list[str], env: dict[str, str]) -> Run:
    """Start `cmd`; timestamp its stdout chunks and stderr lines as they arrive."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    r = Run()
    fds = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    pending = b""
    first = None
    while fds:
        ready, _, _ = select.select(list(fds), [], [])
        for fd in ready:
            data = os.read(fd, 1 << 16)
            now = time.perf_counter() - t0
            if not data:
                del fds[fd]
                continue
            if fds[fd] == "out":
                first = now if first is None and data.strip() else first
                continue
            pending += data
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                r.stderr.append(line)
                if "compiling the CPU kernels" in line:
                    r.compile_line_s = now
                elif "kernels compiled in" in line:
                    r.compiled_line_s = now
                m = re.search(r"load time =\s*([\d.]+) ms", line)
                if m:
                    r.load_s = float(m.group(1)) / 1e3
    code = proc.wait()
    r.total_s = time.perf_counter() - t0
    now_used = resource.getrusage(resource.RUSAGE_CHILDREN)
    r.cpu_s = (now_used.ru_utime - used.ru_utime) + (now_used.ru_stime - used.ru_stime)
    if code != 0 or first is None:
        sys.stderr.write("\n".join(r.stderr[-20:]) + "\n")
        raise SystemExit(f"exit {code}: {' '.join(cmd)}")
    r.first_token_s = first
    return r


def ggrun_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("ggrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ggrun.cli.app"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", help="known model names, in order (default: smollm2, gemma3-270m)")
    ap.add_argument("-p", "--prompt", default="The three most useful things to know about the ocean are")
    ap.add_argument("-n", type=int, default=16, help="tokens to generate")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: ggrun's)")
    args = ap.parse_args()
    models = args.model or ["smollm2", "gemma3-270m"]
    load = os.getloadavg()[0]
    home = Path(os.environ.get("GGRUN_CACHE", Path.home() / ".cache" / "ggrun")).expanduser()
    for name in models:
        if not (home / "models" / KNOWN.get(name, name)).is_file():
            raise SystemExit(f"{home / 'models' / KNOWN.get(name, name)}: not found (ggrun models pull {name})")
    with tempfile.TemporaryDirectory(prefix="ggrun-first-run-") as work:
        cache = Path(work) / "cache"
        cache.mkdir()
        (cache / "models").symlink_to(home / "models")
        env = dict(os.environ, GGRUN_CACHE=str(cache), PYTHONPYCACHEPREFIX=str(Path(work) / "pyc"))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        rows = []
        for label, name in [(f"{m} (first)", m) for m in models] + [(f"{m} (again)", m) for m in models]:
            cmd = [*ggrun_cmd(), "run", "-no-cnv", "-m", name, "-p", args.prompt, "-n", str(args.n), "--temp", "0"]
            if args.threads is not None:
                cmd += ["-t", str(args.threads)]
            r = run(cmd, env)
            rows.append((label, r))
            print(f"{label}: first token {r.first_token_s:.1f} s", file=sys.stderr)
    print(f"-p {args.prompt!r} -n {args.n} --temp 0, threads {args.threads or 'default'}; an empty kernel cache "
          f"before the first row, shared by the rows after it")
    print(f"load average before: {load:.1f} on {os.cpu_count()} CPUs; GGRUN_COMPILE_JOBS="
          f"{os.environ.get('GGRUN_COMPILE_JOBS', 'default')}")
    print("| run | first token, s | start | load | compile | prompt | whole run, s | CPU time, s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        s = r.split()
        print(f"| {label} | {r.first_token_s:.1f} | {s['start']:.1f} | {s['load']:.1f} | {s['compile']:.1f} | "
              f"{s['prompt']:.1f} | {r.total_s:.1f} | {r.cpu_s:.1f} |")


if __name__ == "__main__":
    main()
