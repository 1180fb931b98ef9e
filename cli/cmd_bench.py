"""`ggrun bench`: llama-bench's tests, options and output formats (cli/bench_output.py), from Python.

Every option takes llama-bench's lists: repeated (`-n 0 -n 16`), comma-separated, and integer ranges
(`-t 1-4`, `-p 64-512*2`); the configurations are their cartesian product in llama-bench's order, each
model loaded once per -ngl value. Rows go to stdout as each test finishes, progress to stderr
(`--progress`: llama-bench's lines). Ctrl-C prints the rows already measured (a test cut short is left
out), then `interrupted`, exit 130.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

import typer
from rich.progress import Progress

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.bench_output import FORMATS, Printer
from ggrun.cli.cmd_batched_bench import BatchedBenchSettings, run_batched_bench
from ggrun.cli.cmd_version import build_commit, ggrun_version
from ggrun.cli.cmdline import command_from
from ggrun.cli.common import err_console, list_devices, load_model
from ggrun.cli.interrupt import Interrupt
from ggrun.cli.value_lists import int_values, str_values
from ggrun.core.backends.cpu import set_threads
from ggrun.core.backends.cpu.jit import poll as current_poll
from ggrun.core.backends.cpu.jit import threads as current_threads
from ggrun.core.backends.cpu.threads import DEFAULT_POLL
from ggrun.core.backends.registry import probe, usable_backends
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.bench import BenchResult, BenchTest, cpu_description, run_bench
from ggrun.core.llm.model import Model
from ggrun.core.llm.model_desc import model_description
from ggrun.core.llm.placement import DeviceSplit, select_devices
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.download import resolve_model
from ggrun.loaders.gguf_file import open_gguf

FLASH_ATTN = {"on": 1, "off": 0, "auto": -1}  # llama-bench's flash_attn field: 1, 0, -1 (auto)


@dataclass(frozen=True)
class Config:
    """One row: a model and one value of every option, and the test run with them."""

    model: str
    n_gpu_layers: int  # -1: every layer (llama-bench's default spelling)
    split: DeviceSplit  # -sm, -mg, -dev, -ts
    n_batch: int
    n_ubatch: int  # as given; a session uses at most n_batch, as llama.cpp's context does
    type_k: DType
    type_v: DType
    flash_attn: int  # 1, 0 or -1 (auto: fused, as llama.cpp chooses on the CPU)
    n_threads: int | None  # None: ggrun's default
    graph_reuse: bool
    test: BenchTest
    n_ctx: int


@dataclass(frozen=True)
class BenchSettings:
    """What a `ggrun bench` command line asks for; every tuple is one option's list of values."""

    models: tuple[str, ...] = ("smollm2",)
    n_prompt: tuple[int, ...] = (512,)
    n_gen: tuple[int, ...] = (128,)
    pg: tuple[tuple[int, int], ...] = ()
    n_depth: tuple[int, ...] = (0,)
    n_batch: tuple[int, ...] = (2048,)
    n_ubatch: tuple[int, ...] = (512,)
    type_k: tuple[DType, ...] = (DType.F16,)
    type_v: tuple[DType, ...] = (DType.F16,)
    flash_attn: tuple[int, ...] = (-1,)
    n_threads: tuple[int | None, ...] = (None,)
    poll: int | None = None  # --poll, one level (OpenMP fixes its threads' wait when they start); None: the default
    n_gpu_layers: tuple[int, ...] = (0,)
    split_mode: tuple[str, ...] = ("layer",)
    main_gpu: tuple[int, ...] = (0,)
    devices: tuple[tuple[str, ...] | None, ...] = (None,)  # None: every device ("auto")
    tensor_split: tuple[tuple[float, ...], ...] = ((),)
    graph_reuse: tuple[bool, ...] = (True,)
    n_ctx: int | None = None  # None: what each test needs
    repetitions: int = 5
    numerics: str = "llama"
    output: str = "md"
    progress: bool = False
    warmup: bool = True
    verbose: bool = False
    list_devices: bool = False

    def tests(self) -> list[BenchTest]:
        """llama-bench's order: the pp tests, the tg tests, then the pg pairs (a 0 count is no test)."""
        return ([BenchTest(p, 0) for p in self.n_prompt if p > 0] + [BenchTest(0, n) for n in self.n_gen if n > 0]
                + [BenchTest(p, n) for p, n in self.pg])

    def configs(self) -> list[Config]:
        """The cartesian product of every list, in llama-bench's nesting (the model outermost, so each is
        loaded once), checked before anything is loaded."""
        if not self.tests():
            raise BadInput("no test to run: give -p, -n or -pg with positive counts")
        out = []
        for m, ngl, sm, mg, dev, ts, b, ub, tk, tv, fa, reuse, t, d in itertools.product(
                self.models, self.n_gpu_layers, self.split_mode, self.main_gpu, self.devices, self.tensor_split,
                self.n_batch, self.n_ubatch, self.type_k, self.type_v, self.flash_attn, self.graph_reuse,
                self.n_threads, self.n_depth):
            split = DeviceSplit(devices=dev, mode=sm, tensor_split=ts, main_gpu=mg)
            split.check()
            for test in self.tests():
                test = BenchTest(test.n_prompt, test.n_gen, d)
                n_ctx = self.n_ctx if self.n_ctx is not None else test.n_ctx
                if test.n_ctx > n_ctx:
                    raise BadInput(f"test {test.label} needs {test.n_ctx} tokens, more than the context (-c {n_ctx})")
                out.append(Config(m, ngl, split, b, ub, tk, tv, fa, t, reuse, test, n_ctx))
        return out

    def md_columns(self, device: bool) -> tuple[str, ...]:
        """llama-bench's rule: threads always on a CPU, ngl where a device exists, any other option's
        column when it was given more than one value or a value other than its default."""
        d = BenchSettings()
        cols = ["n_gpu_layers"] if device else []
        cols.append("n_threads")
        if self.poll not in (None, DEFAULT_POLL):
            cols.append("poll")
        for name in ("n_batch", "n_ubatch", "type_k", "type_v", "split_mode", "main_gpu", "flash_attn", "devices",
                     "tensor_split", "graph_reuse"):
            if getattr(self, name) != getattr(d, name):
                cols.append(name)
        return tuple(cols)


def settings(
    model: Optional[list[str]] = typer.Option(None, "-m", "--model", help="Model file(s) or known names; repeat or comma-separate"),
    n_prompt: Optional[list[str]] = typer.Option(None, "-p", "--n-prompt", help="Prompt lengths (default 512)"),
    n_gen: Optional[list[str]] = typer.Option(None, "-n", "--n-gen", help="Generation lengths (default 128; 0: none)"),
    pg: Optional[list[str]] = typer.Option(None, "-pg", help="Prompt then generation: PP,TG (repeatable)"),
    n_depth: Optional[list[str]] = typer.Option(None, "-d", "--n-depth", help="Tokens already in the KV cache (default 0)"),
    batch_size: Optional[list[str]] = typer.Option(None, "-b", "--batch-size", help="Batch sizes (default 2048)"),
    ubatch_size: Optional[list[str]] = typer.Option(None, "-ub", "--ubatch-size", help="Micro-batch sizes (default 512)"),
    cache_type_k: Optional[list[str]] = typer.Option(None, "-ctk", "--cache-type-k", help="KV cache types for K (default f16)"),
    cache_type_v: Optional[list[str]] = typer.Option(None, "-ctv", "--cache-type-v", help="KV cache types for V (default f16)"),
    threads: Optional[list[str]] = typer.Option(None, "-t", "--threads", help="CPU thread counts (default: ggrun's)"),
    poll: Optional[list[str]] = typer.Option(None, "--poll", help=f"Polling level of idle CPU threads, 0..100, one value (0: they sleep at once; default {DEFAULT_POLL})"),
    n_gpu_layers: Optional[list[str]] = typer.Option(None, "-ngl", "--n-gpu-layers", help="Layers offloaded (default 0; -1: all)"),
    split_mode: Optional[list[str]] = typer.Option(None, "-sm", "--split-mode", help="none|layer|row (default layer)"),
    main_gpu: Optional[list[str]] = typer.Option(None, "-mg", "--main-gpu", help="Main device indexes (default 0)"),
    device: Optional[list[str]] = typer.Option(None, "-dev", "--device", help="Device lists, each dev0/dev1/... or none (default: every device)"),
    tensor_split: Optional[list[str]] = typer.Option(None, "-ts", "--tensor-split", help="Splits, each ts0/ts1/... (default 0: by free memory)"),
    flash_attn: Optional[list[str]] = typer.Option(None, "-fa", "--flash-attn", help="Fused attention: on|off|auto or 1|0|-1 (default auto: on)"),
    graph_reuse: Optional[list[str]] = typer.Option(None, "--graph-reuse", help="Graph reuse off/on: 0,1 (default 1)"),
    ctx_size: Optional[int] = typer.Option(None, "-c", "--ctx-size", help="Context size (default: what each test needs)"),
    repetitions: int = typer.Option(5, "-r", "--repetitions", help="Timed repetitions per test"),
    numerics: o.Numerics = "llama",
    output: str = typer.Option("md", "-o", "--output", "--output-format", help="md, csv, json, jsonl or sql (--batched: md, json, jsonl)"),
    progress: bool = typer.Option(False, "--progress", help="Print llama-bench's progress lines on stderr"),
    no_warmup: bool = typer.Option(False, "--no-warmup", help="Skip the untimed warm-up run of each test"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Log each repetition on stderr"),
    list_devices_: o.ListDevices = False,
    batched: bool = typer.Option(False, "--batched", help="llama-batched-bench's job: B sequences at once (-npp, -ntg, -npl, -pps)"),
    npp: Optional[list[str]] = typer.Option(None, "-npp", help="--batched: prompt tokens per sequence (default 128)"),
    ntg: Optional[list[str]] = typer.Option(None, "-ntg", help="--batched: generated tokens per sequence (default 128)"),
    npl: Optional[list[str]] = typer.Option(None, "-npl", help="--batched: sequences decoded at once (default 1)"),
    pps: bool = typer.Option(False, "-pps", help="--batched: one prompt shared by every sequence"),
) -> BenchSettings | BatchedBenchSettings:
    """Benchmark prompt processing and generation (like llama-bench; with --batched like llama-batched-bench)."""
    if list_devices_:
        return BenchSettings(list_devices=True)
    if batched:
        return _batched_settings(model, npp, ntg, npl, pps, ctx_size, batch_size, ubatch_size, threads, poll,
                                 n_gpu_layers, device, split_mode, tensor_split, main_gpu, cache_type_k,
                                 cache_type_v, flash_attn, graph_reuse, numerics, output, not no_warmup)
    if npp or ntg or npl or pps:
        raise BadInput("-npp, -ntg, -npl and -pps belong to bench --batched")
    if output not in FORMATS:
        raise BadInput(f"-o {output}: choose one of {', '.join(FORMATS)}")
    if repetitions < 1:
        raise BadInput(f"-r {repetitions} must be positive")
    if ctx_size is not None and ctx_size < 1:
        raise BadInput(f"-c {ctx_size} must be positive")
    reuse = int_values(graph_reuse, "--graph-reuse", [1])
    if any(x not in (0, 1) for x in reuse):
        raise BadInput(f"--graph-reuse {','.join(graph_reuse)}: values must be 0 or 1")
    n_threads = int_values(threads, "-t", [], minimum=1) or (None,)
    level = _poll(poll)
    s = BenchSettings(
        models=str_values(model, ["smollm2"]), n_prompt=int_values(n_prompt, "-p", [512]),
        n_gen=int_values(n_gen, "-n", [128]), pg=tuple(_pg(v) for v in pg or ()),
        n_depth=int_values(n_depth, "-d", [0]), n_batch=int_values(batch_size, "-b", [2048], minimum=1),
        n_ubatch=int_values(ubatch_size, "-ub", [512], minimum=1),
        type_k=tuple(_cache_type(v, "-ctk") for v in str_values(cache_type_k, ["f16"])),
        type_v=tuple(_cache_type(v, "-ctv") for v in str_values(cache_type_v, ["f16"])),
        flash_attn=tuple(_flash_attn(v) for v in str_values(flash_attn, ["auto"])), n_threads=n_threads, poll=level,
        n_gpu_layers=int_values(n_gpu_layers, "-ngl", [0], allow_negative=True, minimum=-1),
        split_mode=str_values(split_mode, ["layer"]), main_gpu=int_values(main_gpu, "-mg", [0]),
        devices=tuple(None if v == "auto" else o.parse_devices(v) for v in str_values(device, ["auto"])),
        tensor_split=tuple(_tensor_split(v) for v in str_values(tensor_split, ["0"])),
        graph_reuse=tuple(bool(x) for x in reuse), n_ctx=ctx_size, repetitions=repetitions, numerics=numerics,
        output=output, progress=progress, warmup=not no_warmup, verbose=verbose)
    s.configs()  # every combination is checked before a model is read
    return s


def _one(values: Optional[list[str]], flag: str) -> str | None:
    """The single value of an option that --batched takes once (llama-batched-bench has no lists of it)."""
    items = str_values(values, [])
    if len(items) > 1:
        raise BadInput(f"{flag} {','.join(items)}: bench --batched takes one value")
    return items[0] if items else None


def _poll(values: Optional[list[str]]) -> int | None:
    """--poll's one level (None: not given). llama-bench takes a list, but OpenMP reads its threads' wait
    settings once, when they start, so one process cannot measure several."""
    levels = int_values(values, "--poll", [], minimum=0)
    if len(levels) > 1:
        raise BadInput(f"--poll {','.join(values)}: ggrun bench takes one level (its threads' wait is set when they start)")
    level = levels[0] if levels else None
    o.check_poll(level)
    return level


def _batched_settings(model, npp, ntg, npl, pps, ctx_size, batch_size, ubatch_size, threads, poll, n_gpu_layers, device,
                      split_mode, tensor_split, main_gpu, cache_type_k, cache_type_v, flash_attn, graph_reuse,
                      numerics, output, warmup: bool = True) -> BatchedBenchSettings:
    """The record of a `bench --batched` line: the lists llama-batched-bench takes, one value of the rest."""
    if ctx_size is not None and ctx_size < 1:
        raise BadInput(f"-c {ctx_size} must be positive")
    one = {flag: _one(v, flag) for flag, v in (("-m", model), ("-b", batch_size), ("-ub", ubatch_size),
                                               ("-t", threads), ("-ngl", n_gpu_layers), ("-dev", device),
                                               ("-sm", split_mode), ("-ts", tensor_split), ("-mg", main_gpu),
                                               ("-ctk", cache_type_k), ("-ctv", cache_type_v),
                                               ("-fa", flash_attn), ("--graph-reuse", graph_reuse))}

    def num(flag: str, default: int, minimum: int = 1) -> int:
        v = one[flag]
        return default if v is None else int_values([v], flag, [default], allow_negative=flag == "-ngl",
                                                     minimum=minimum)[0]

    dev = one["-dev"]
    split = DeviceSplit(devices=None if dev in (None, "auto") else o.parse_devices(dev), mode=one["-sm"] or "layer",
                        tensor_split=_tensor_split(one["-ts"] or "0"), main_gpu=num("-mg", 0, 0))
    split.check()
    s = BatchedBenchSettings(
        model=one["-m"] or "smollm2", npp=int_values(npp, "-npp", [128]), ntg=int_values(ntg, "-ntg", [128]),
        npl=int_values(npl, "-npl", [1], minimum=1), shared=pps, n_ctx=ctx_size, n_batch=num("-b", 2048),
        n_ubatch=num("-ub", 512), n_threads=None if one["-t"] is None else num("-t", 1), poll=_poll(poll),
        n_gpu_layers=num("-ngl", 0, -1), split=split,
        type_k=_cache_type(one["-ctk"] or "f16", "-ctk"), type_v=_cache_type(one["-ctv"] or "f16", "-ctv"),
        flash_attn=_flash_attn(one["-fa"] or "auto"), graph_reuse=num("--graph-reuse", 1, 0) != 0,
        numerics=numerics, output=output, warmup=warmup)
    s.check()
    return s


def _pg(value: str) -> tuple[int, int]:
    try:
        pp, tg = (int(x) for x in value.split(","))
    except ValueError:
        raise BadInput(f"-pg {value}: expected PP,TG (two integers)") from None
    if pp < 1 or tg < 1:
        raise BadInput(f"-pg {value}: both counts must be positive")
    return pp, tg


def _tensor_split(value: str) -> tuple[float, ...]:
    """One -ts value (ts0/ts1/...); all zero is no split given (by free memory), as llama-bench's default 0."""
    split = o.parse_tensor_split(value)
    return split if any(split) else ()


def _flash_attn(value: str) -> int:
    try:
        return FLASH_ATTN[o.parse_on_off_auto(value)]
    except typer.BadParameter as err:
        raise BadInput(f"-fa {err}") from None


def _cache_type(value: str, flag: str) -> DType:
    try:
        return o.parse_cache_type(value)
    except typer.BadParameter as err:
        raise BadInput(f"{flag} {err}") from None


def run(s: BenchSettings | BatchedBenchSettings) -> None:
    if isinstance(s, BatchedBenchSettings):
        run_batched_bench(s, _gpu_layers(s.n_gpu_layers))
        return
    if s.list_devices:
        list_devices()
        return
    configs = s.configs()
    paths = {m: resolve_model(m) for m in s.models}
    for p in paths.values():  # a model that cannot be read fails now, before any other is loaded or timed
        with open_gguf(p) as gf:
            Model.read_hparams(gf)
    for split in dict.fromkeys(cfg.split for cfg in configs):  # and so do devices this machine lacks
        select_devices(usable_backends(), split)
    device = any(i.available and i.name != "CPU" for i in probe())
    printer = Printer(s.output, s.md_columns(device))
    with Interrupt() as stop:
        try:
            _run_all(s, configs, paths, printer, stop)
        except Interrupted:
            pass
    printer.footer(f"{build_commit()} (ggrun {ggrun_version()})")
    if stop.requested:
        raise Interrupted()


app.command("bench")(command_from(settings, run))


def _run_all(s: BenchSettings, configs: list[Config], paths: dict, printer: Printer, stop: Interrupt) -> None:
    """Run every configuration, printing its row as soon as it is measured."""
    loaded: tuple[tuple, Model] | None = None
    with Progress(console=err_console, transient=True, disable=s.progress) as bar:
        task = bar.add_task("benchmarking", total=len(configs) * s.repetitions)
        for idx, cfg in enumerate(configs, 1):
            if stop.requested:  # Ctrl-C while loading: no session polled it yet
                raise Interrupted()

            def say(what: str, idx=idx) -> None:
                if s.progress:
                    err_console.print(f"ggrun bench: benchmark {idx}/{len(configs)}: {what}", markup=False)

            say("starting")
            key = (cfg.model, cfg.n_gpu_layers, cfg.split)
            if loaded is None or loaded[0] != key:
                loaded = None  # the previous model's memory goes before the next one's is taken
                m = load_model(cfg.model, _gpu_layers(cfg.n_gpu_layers), quiet=True, threads=cfg.n_threads,
                               numerics=s.numerics, split=cfg.split, kv_types=(cfg.type_k, cfg.type_v), poll=s.poll)
                loaded = (key, m)
            m = loaded[1]
            set_threads(cfg.n_threads)
            params = SessionParams(n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch, type_k=cfg.type_k,
                                   type_v=cfg.type_v, graph_reuse=cfg.graph_reuse, flash_attn=cfg.flash_attn != 0)
            session = stop.watch(Session(m, params))
            bar.update(task, description=f"{paths[cfg.model].name} {cfg.test.label}")

            def tick(i: int, cfg=cfg) -> None:
                bar.advance(task)
                if s.verbose:
                    err_console.print(f"{cfg.test.label}: repetition {i + 1}/{s.repetitions} done", markup=False)

            res = run_bench(session, cfg.test, s.repetitions, warmup=s.warmup, on_rep=tick, on_event=say)
            printer.row(record(cfg, m, paths[cfg.model], res, s.numerics))


def _gpu_layers(n: int) -> int:
    return o.GPU_LAYERS_ALL if n < 0 else n


def record(cfg: Config, m: Model, path: Path, res: BenchResult, numerics: str) -> dict:
    """One result with llama-bench's field names and values where the same thing is meant."""
    devices = m.backends[:-1]  # the devices the model may use, as llama-bench lists its GPU backends
    kinds = list(dict.fromkeys(b.name.rstrip("0123456789") for b in devices))  # CUDA0, CUDA1 -> CUDA
    return {
        "build_commit": build_commit(),
        "cpu_info": cpu_description(),
        "gpu_info": ", ".join(b.device for b in devices),
        "backends": ",".join(kinds) or "CPU",
        "model_filename": str(path),
        "model_type": model_description(m.gguf, m.hp.n_layer, m.hp.n_vocab, m.hp.n_head, m.hp.n_head_kv),
        "model_size": m.file_bytes,
        "model_n_params": m.n_params,
        "n_batch": cfg.n_batch,
        "n_ubatch": cfg.n_ubatch,
        "n_threads": current_threads(),
        "poll": current_poll(),
        "type_k": cfg.type_k.label,
        "type_v": cfg.type_v.label,
        "n_gpu_layers": cfg.n_gpu_layers,
        "split_mode": cfg.split.mode,
        "main_gpu": cfg.split.main_gpu,
        "flash_attn": cfg.flash_attn,
        "devices": _devices_text(cfg.split.devices),
        "tensor_split": _split_text(cfg.split.tensor_split),
        "n_prompt": cfg.test.n_prompt,
        "n_gen": cfg.test.n_gen,
        "n_depth": cfg.test.n_depth,
        "test_time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "avg_ns": int(res.avg_ns),
        "stddev_ns": int(res.stddev_ns),
        "avg_ts": res.avg_ts,
        "stddev_ts": res.stddev_ts,
        "ggrun_version": ggrun_version(),
        "n_ctx": cfg.n_ctx,
        "graph_reuse": int(cfg.graph_reuse),
        "numerics": numerics,
        "samples_ns": res.samples_ns,
        "samples_ts": res.samples_ts,
    }


def _devices_text(devices: tuple[str, ...] | None) -> str:
    """llama-bench's devices field: auto (every device), none, or the names joined by '/'."""
    if devices is None:
        return "auto"
    return "/".join(devices) or "none"


def _split_text(split: tuple[float, ...]) -> str:
    """llama-bench's tensor_split field: each proportion as %.2f up to the last non-zero, joined by '/'."""
    last = max((i for i, x in enumerate(split) if x > 0), default=0)
    return "/".join(f"{x:.2f}" for x in (split or (0.0,))[:last + 1])
