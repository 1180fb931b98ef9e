"""`ggrun bench`: llama-bench's tests, options and output formats, from Python.

Comma lists expand to the cartesian product of configurations; each model is loaded
once per -ngl value. Results go to stdout, progress to stderr. Ctrl-C prints the rows already
measured (a test cut short is left out), then `interrupted`, exit 130.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone

import typer
from rich.progress import Progress

from ggrun.cli.app import app
from ggrun.cli.cmd_measure import parse_int_list
from ggrun.cli.cmd_version import ggrun_version
from ggrun.cli.common import err_console, list_devices, load_model
from ggrun.cli.interrupt import Interrupt
from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.bench import BenchResult, BenchTest, run_bench
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.download import resolve_model
from ggrun.loaders.gguf_file import open_gguf

FORMATS = ("md", "csv", "json", "jsonl")


@dataclass(frozen=True)
class Config:
    model: str
    n_gpu_layers: int
    n_batch: int
    n_ubatch: int
    graph_reuse: bool
    test: BenchTest
    n_ctx: int
    flash_attn: bool = False


def parse_pg(values: list[str]) -> list[BenchTest]:
    tests = []
    for v in values:
        try:
            pp, tg = (int(x) for x in v.split(","))
        except ValueError:
            raise BadInput(f"-pg {v}: expected PP,TG (two integers)") from None
        if pp < 1 or tg < 1:
            raise BadInput(f"-pg {v}: both counts must be positive")
        tests.append(BenchTest(pp, tg))
    return tests


def plan_configs(models: list[str], prompts: list[int], gens: list[int], pgs: list[BenchTest], batches: list[int],
                 ubatches: list[int], ngls: list[int], reuse: list[bool], ctx: int | None,
                 flash_attn: tuple[bool, ...] = (False,)) -> list[Config]:
    """The cartesian product of every option list, checked before anything is loaded."""
    tests = [BenchTest(p, 0) for p in prompts if p > 0] + [BenchTest(0, n) for n in gens if n > 0] + pgs
    if not tests:
        raise BadInput("no test to run: give -p, -n or -pg with positive counts")
    configs = []
    for m, ngl, b, ub, r, fa, t in itertools.product(models, ngls, batches, ubatches, reuse, flash_attn, tests):
        if ub > b:
            raise BadInput(f"-ub {ub} is larger than -b {b}")
        n_ctx = ctx if ctx is not None else t.n_tokens
        if t.n_tokens > n_ctx:
            raise BadInput(f"test {t.label} needs {t.n_tokens} tokens, more than the context (-c {n_ctx})")
        configs.append(Config(m, ngl, b, ub, r, t, n_ctx, fa))
    return configs


def _split_models(values: list[str]) -> list[str]:
    return [m for v in values for m in v.split(",") if m]


@app.command("bench")
def bench_command(
    model: list[str] = typer.Option(None, "-m", "--model", help="Model file(s) or known names; repeat or comma-separate"),
    n_prompt: str = typer.Option("512", "-p", "--n-prompt", help="Prompt lengths (comma list)"),
    n_gen: str = typer.Option("128", "-n", "--n-gen", help="Generation lengths (comma list)"),
    pg: list[str] = typer.Option(None, "-pg", help="Prompt then generation: PP,TG (repeatable)"),
    batch_size: str = typer.Option("2048", "-b", "--batch-size", help="Batch sizes (comma list)"),
    ubatch_size: str = typer.Option("512", "-ub", "--ubatch-size", help="Micro-batch sizes (comma list)"),
    ctx_size: int = typer.Option(None, "-c", "--ctx-size", help="Context size (default: what each test needs)"),
    n_gpu_layers: str = typer.Option("0", "-ngl", "--n-gpu-layers", help="Layers offloaded (comma list)"),
    repetitions: int = typer.Option(5, "-r", "--repetitions", help="Timed repetitions per test"),
    threads: int = typer.Option(None, "-t", "--threads", help="CPU threads for matrix products (default: all cores)"),
    numerics: str = typer.Option("llama", "--numerics", help="llama (llama.cpp's operand rounding) or f32"),
    graph_reuse: str = typer.Option("1", "--graph-reuse", help="Graph reuse off/on (comma list of 0,1)"),
    flash_attn: str = typer.Option("1", "-fa", "--flash-attn", help="Fused attention off/on (comma list of 0,1)"),
    output: str = typer.Option("md", "-o", "--output", help="md, csv, json or jsonl"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Log each repetition on stderr"),
    list_devices_: bool = typer.Option(False, "--list-devices", help="List the usable backends and exit"),
) -> None:
    """Benchmark prompt processing and generation (like llama-bench)."""
    if list_devices_:
        list_devices()
        return
    if output not in FORMATS:
        raise BadInput(f"-o {output}: choose one of {', '.join(FORMATS)}")
    if repetitions < 1:
        raise BadInput(f"-r {repetitions} must be positive")
    if ctx_size is not None and ctx_size < 1:
        raise BadInput(f"-c {ctx_size} must be positive")
    prompts = _nonneg_list(n_prompt, "-p")
    gens = _nonneg_list(n_gen, "-n")
    ngls = _nonneg_list(n_gpu_layers, "-ngl")
    reuse = _switch_list(graph_reuse, "--graph-reuse")
    fa = tuple(_switch_list(flash_attn, "-fa"))
    models = _split_models(model or ["smollm2"])
    configs = plan_configs(models, prompts, gens, parse_pg(pg or []), parse_int_list(batch_size, "-b"),
                           parse_int_list(ubatch_size, "-ub"), ngls, reuse, ctx_size, fa)
    paths = {m: resolve_model(m) for m in models}
    for p in paths.values():  # a model that cannot be read fails now, before any other is loaded or timed
        with open_gguf(p) as gf:
            Model.read_hparams(gf)
    if threads is not None and threads < 1:
        raise BadInput(f"-t {threads} must be positive")
    results: list[dict] = []
    with Interrupt() as stop:
        try:
            _run_all(configs, paths, repetitions, verbose, threads, numerics, results, stop)
        except Interrupted:
            pass
    if results or not stop.requested:
        sys.stdout.write(render(results, output))
    if stop.requested:
        raise Interrupted()


def _switch_list(text: str, flag: str) -> list[bool]:
    """'0,1' -> [False, True]."""
    values = _nonneg_list(text, flag)
    if any(x not in (0, 1) for x in values):
        raise BadInput(f"{flag} {text}: values must be 0 or 1")
    return [bool(x) for x in values]


def _nonneg_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{flag} {text}: expected a comma-separated list of integers") from None
    if any(v < 0 for v in values):
        raise BadInput(f"{flag} {text}: values must not be negative")
    return values


def _run_all(configs: list[Config], paths: dict, repetitions: int, verbose: bool, threads: int | None,
             numerics: str, out: list[dict], stop: Interrupt) -> None:
    """Run every configuration, appending its row to `out` as soon as it is measured."""
    loaded: tuple[tuple[str, int], Model] | None = None
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(configs) * repetitions)
        for cfg in configs:
            if stop.requested:  # Ctrl-C while loading: no session polled it yet
                raise Interrupted()
            key = (cfg.model, cfg.n_gpu_layers)
            if loaded is None or loaded[0] != key:
                m = load_model(cfg.model, cfg.n_gpu_layers, quiet=True, threads=threads, numerics=numerics)
                loaded = (key, m)
            m = loaded[1]
            params = SessionParams(n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
                                   graph_reuse=cfg.graph_reuse, flash_attn=cfg.flash_attn)
            session = stop.watch(Session(m, params))
            progress.update(task, description=f"{paths[cfg.model].name} {cfg.test.label}")

            def tick(i: int, cfg=cfg) -> None:
                progress.advance(task)
                if verbose:
                    err_console.print(f"{cfg.test.label}: repetition {i + 1}/{repetitions} done", markup=False)

            res = run_bench(session, cfg.test, repetitions, on_rep=tick)
            out.append(record(cfg, m, paths[cfg.model], res))


def record(cfg: Config, m: Model, path, res: BenchResult) -> dict:
    """One result with llama-bench's field names where the same thing is meant."""
    return {
        "ggrun_version": ggrun_version(),
        "backends": ",".join(b.name for b in m.backends),
        "model_filename": str(path),
        "model_type": model_type(m),
        "model_size": m.file_bytes,
        "model_n_params": m.n_params,
        "n_batch": cfg.n_batch,
        "n_ubatch": cfg.n_ubatch,
        "n_ctx": cfg.n_ctx,
        "n_gpu_layers": cfg.n_gpu_layers,
        "graph_reuse": int(cfg.graph_reuse),
        "flash_attn": int(cfg.flash_attn),
        "n_prompt": cfg.test.n_prompt,
        "n_gen": cfg.test.n_gen,
        "test": cfg.test.label,
        "test_time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "avg_ns": int(res.avg_ns),
        "stddev_ns": int(res.stddev_ns),
        "avg_ts": res.avg_ts,
        "stddev_ts": res.stddev_ts,
        "samples_ns": res.samples_ns,
        "samples_ts": res.samples_ts,
    }


def model_type(m: Model) -> str:
    """llama-bench's model description: architecture, size label, stored type."""
    label = m.gguf.get("general.size_label") or _size_label(m.n_params)
    return f"{m.hp.arch} {label} {m.type_label}"


def _size_label(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{round(n / 1e6)}M"


def render(results: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(results, indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in results)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(results[0]) if results else [])
        w.writeheader()
        for r in results:
            w.writerow({k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()})
        return buf.getvalue()
    return markdown(results)


def markdown(results: list[dict]) -> str:
    """llama-bench's table: fixed columns, then the options that vary across rows, test, t/s."""
    varying = [k for k in ("n_batch", "n_ubatch", "flash_attn", "graph_reuse") if len({r[k] for r in results}) > 1]
    cols = ["model", "size", "params", "backend", "ngl", *varying, "test", "t/s"]
    right = {"size", "params", "ngl", "n_batch", "n_ubatch", "flash_attn", "graph_reuse", "test", "t/s"}
    rows = []
    for r in results:
        cells = {
            "model": r["model_type"], "size": f"{r['model_size'] / 2**20:.2f} MiB",
            "params": f"{r['model_n_params'] / 1e6:.2f} M", "backend": r["backends"].replace(",CPU", "") or "CPU",
            "ngl": str(r["n_gpu_layers"]), "test": r["test"], "t/s": f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}",
        }
        cells.update({k: str(r[k]) for k in varying})
        rows.append([cells[c] for c in cols])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    def line(vals):
        return "| " + " | ".join(v.rjust(w) if c in right else v.ljust(w) for v, w, c in zip(vals, widths, cols)) + " |"
    sep = "| " + " | ".join(("-" * (w - 1) + ":") if c in right else "-" * w for w, c in zip(widths, cols)) + " |"
    # llama-bench ends its table with the build that produced it
    build = f"\nbuild: ggrun {results[0]['ggrun_version']}\n" if results else ""
    return "\n".join([line(cols), sep, *(line(r) for r in rows)]) + "\n" + build
