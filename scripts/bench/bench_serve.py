"""`ggrun serve` against llama.cpp's `llama-server` under the same load, measured in one run.

Both servers are started on free loopback ports with the same model, context, slots and threads; for each
concurrency level (1, 8, 32 by default) each server in turn (alternating over --rounds) gets the same
requests from that many concurrent streaming clients: chat completions of llama-parallel's questions, greedy,
--n tokens each (ignore_eos, so every reply is as long); below MIN_REQUESTS clients each sends its requests one
after another until the level has sent MIN_REQUESTS (c=1: 8 in a row; one request a round let a single slow
request set the level's figures). Per level it prints each server's generated tokens
per second (all replies' tokens over the level's wall time), time to first token p50 and p99, and the ratios
ggrun / llama-server; and the HTTP layer's share of a request's time: 1 - (the server's own prompt_ms +
predicted_ms, from the timings in its last chunk) / (the time the client saw from sending to the last byte).
A warm-up pass at each level runs first on each (ggrun compiles its kernels and captures its graphs for new
shapes there). A reply of other than --n tokens is counted and named: the ratios compare equal work only.
Server logs go to --log-dir; SIGTERM (as `timeout` sends) stops both servers before the script exits.

llama-server comes from `bash /work/shared/tools/cpu_anchor.sh` (--llama-bin or $LLAMA_BIN). It runs with
`--poll 0` (--llama-poll): its idle threads sleep, as ggrun's do (core/backends/cpu/threads.py); at its
default (50) they spin, and on a shared 2-core machine each parallel step then waits behind other work
(measured here: 0.47 t/s per slot at -np 32, 2.5 t/s at c=1). Loopback only.

On a GPU machine (issue 34's GPU bench: synthetic llama-1b Q4_0 at 1, 16, 64), pass -ngl 99 to both servers
and llama.cpp's CUDA tools' directory (cuda_anchor.sh's build/bin); scripts/bench/serve_gpu.sh runs it so. A
model without a chat template of its own (the synthetic ones, unless written with --tokenizer-from) takes
--chat-template chatml on both. The synthetic models' vocabularies are padded with text tokens: control
tokens, which render as nothing, left both servers streaming no text at all (TTFT then reads n/a).

Usage: python scripts/bench/bench_serve.py [-m MODEL] [--levels 1,8,32] [-n 32] [-np 32] [-c 8192] [-t 2] [--rounds 2]
       [-ngl 0] [--chat-template NAME] [--log-dir /tmp]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ggrun.cli.parallel_prompts import QUESTIONS
from ggrun.loaders.download import resolve_model

DEFAULT_ANCHOR = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"


@dataclass
class Result:
    """One request as the client saw it, with the server's own times for it."""

    ttft: float
    total: float
    n_gen: int
    server_ms: float


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, name: str, log: Path) -> subprocess.Popen:
    """Start a server and wait until its /health says ok."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    with httpx.Client(base_url=url, trust_env=False, timeout=5) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                sys.exit(f"{name} exited {proc.returncode}; see {log}")
            try:
                if c.get("/health").status_code == 200:
                    return proc
            except httpx.TransportError:
                pass
            time.sleep(0.3)
    proc.kill()
    sys.exit(f"{name} did not become healthy; see {log}")


async def one(client: httpx.AsyncClient, question: str, n: int) -> Result:
    """One streamed greedy chat request: its time to the first text, its whole time, tokens and server time."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": False}
    t0 = time.perf_counter()
    ttft, n_gen, server_ms = 0.0, 0, 0.0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if not ttft and ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
            if ev.get("usage"):
                n_gen = ev["usage"]["completion_tokens"]
            if ev.get("timings"):
                server_ms = ev["timings"]["prompt_ms"] + ev["timings"]["predicted_ms"]
    return Result(ttft, time.perf_counter() - t0, n_gen, server_ms)


MIN_REQUESTS = 8  # requests a level sends at least


async def level(url: str, concurrency: int, n: int) -> tuple[float, list[Result]]:
    """`concurrency` clients at once, each sending its share of max(concurrency, MIN_REQUESTS) requests one after
    another; (wall seconds, results)."""
    per_client = max(1, -(-MIN_REQUESTS // concurrency))

    async def client_run(c: int) -> list[Result]:
        """A client's requests, each on a connection of its own (a stream's connection is not reused)."""
        out = []
        for j in range(per_client):
            i = c * per_client + j
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=600) as client:
                out.append(await one(client, f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})", n))
        return out

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client_run(c) for c in range(concurrency)))
    return time.perf_counter() - t0, [r for rs in results for r in rs]


def pct(xs: list[float], q: float) -> float:
    """The q-th quantile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    """Start both servers, warm them up, and measure each level in alternating rounds."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("-n", type=int, default=32, help="tokens per reply")
    ap.add_argument("-np", type=int, default=32, help="slots of each server")
    ap.add_argument("-c", type=int, default=8192)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-ngl", type=int, default=0, help="layers on the GPU, both servers (99: all)")
    ap.add_argument("--chat-template", default="", help="both servers' chat template (for a model without one)")
    ap.add_argument("--llama-poll", type=int, default=0, help="llama-server's --poll (0: idle threads sleep)")
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", str(DEFAULT_ANCHOR)))
    ap.add_argument("--log-dir", default="/tmp", help="where bench_serve_ggrun.log and bench_serve_llama.log go")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_serve: terminated"))  # runs the servers' clean-up
    Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in a.levels.split(",")]
    model = str(resolve_model(a.model))
    server = Path(a.llama_bin) / "llama-server"
    if not server.exists():
        sys.exit(f"no {server}: build it with `bash /work/shared/tools/cpu_anchor.sh` (or give --llama-bin)")
    common = ["-m", model, "-c", str(a.c), "-np", str(a.np), "-t", str(a.t), "-ngl", str(a.ngl), "--host", "127.0.0.1"]
    if a.chat_template:
        common += ["--chat-template", a.chat_template]
    ports = {"ggrun": free_port(), "llama": free_port()}
    cmds = {"ggrun": [sys.executable, "-m", "ggrun.cli.app", "serve", *common, "--port", str(ports["ggrun"]),
                      "--max-queue", "256"],
            "llama": [str(server), *common, "--port", str(ports["llama"]), "-fa", "on", "--no-webui",
                      "--poll", str(a.llama_poll)]}
    urls = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    procs = {}
    try:
        for name in ("ggrun", "llama"):
            procs[name] = start(cmds[name], urls[name], name, Path(a.log_dir) / f"bench_serve_{name}.log")
            for conc in levels:  # warm-up
                asyncio.run(level(urls[name], conc, a.n))
        print(f"model {Path(model).name}, -c {a.c} -np {a.np} -t {a.t} -ngl {a.ngl}, {a.n} tokens per reply, "
              f"{a.rounds} alternating rounds per level")
        for conc in levels:
            runs: dict[str, list[tuple[float, list[Result]]]] = {"ggrun": [], "llama": []}
            for _ in range(a.rounds):
                for name in ("ggrun", "llama"):
                    runs[name].append(asyncio.run(level(urls[name], conc, a.n)))
            report(conc, runs, a.n)
    finally:
        for p in procs.values():
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def report(conc: int, runs: dict, n: int) -> None:
    """Print each server's figures at one level and the ratios, and any replies of other than n tokens."""
    figs = {}
    for name, rs in runs.items():
        short = sorted({r.n_gen for _, res in rs for r in res} - {n})
        if short:
            print(f"  c={conc:3d} {name:5s}: some replies had {short} tokens, not {n}")
        tps = statistics.median(sum(r.n_gen for r in res) / wall for wall, res in rs)
        ttfts = [r.ttft for _, res in rs for r in res]
        http = [1 - r.server_ms / 1e3 / r.total for _, res in rs for r in res if r.total > 0]
        figs[name] = (tps, pct(ttfts, 0.5), pct(ttfts, 0.99), statistics.median(http))
        print(f"  c={conc:3d} {name:5s}: gen {tps:8.2f} t/s  TTFT p50 {1e3 * figs[name][1]:8.1f} ms  "
              f"p99 {1e3 * figs[name][2]:8.1f} ms  HTTP share {100 * figs[name][3]:5.1f} %")
    g, ll = figs["ggrun"], figs["llama"]
    ratios = "  ".join(f"{what} {_ratio(a, b)}" for what, a, b in
                       (("gen t/s", g[0], ll[0]), ("TTFT p50", g[1], ll[1]), ("TTFT p99", g[2], ll[2])))
    print(f"  c={conc:3d} ratio ggrun/llama-server: {ratios}")


def _ratio(a: float, b: float) -> str:
    """a / b as a ratio, or why there is none: a TTFT stays 0 when no chunk carried text (a synthetic model's
    random tokens may decode to no whole character)."""
    return f"{a / b:.2f}x" if a and b else "n/a (no text streamed)"


if __name__ == "__main__":
    main()
