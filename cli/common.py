"""Helpers the commands share: backend listing, model loading with a progress bar,
option checks, and llama.cpp-style timing lines on stderr."""
from __future__ import annotations

import os
import sys
import time

import typer

from ggrun.cli import library_patches
from ggrun.cli import options as o
from ggrun.core.backends.cpu import set_threads
from ggrun.core.backends.registry import probe, usable_backends
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.llm.cpu_kernels import warm_tags
from ggrun.core.llm.model import NUMERICS, Model
from ggrun.core.llm.placement import DeviceSplit
from ggrun.loaders.download import resolve_model



class _StderrConsole:
    """rich's Console on stderr, made (and rich imported) on first use: a run that prints nothing through
    it does not pay for importing rich (50 ms, a twentieth of its start-up). Attributes and the context
    protocol (rich's live displays enter their console) go to the real one."""

    def __init__(self) -> None:
        self._console = None

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True, highlight=False, soft_wrap=True)
        return self._console

    def __getattr__(self, name: str):
        return getattr(self.console, name)

    def __enter__(self):
        return self.console.__enter__()

    def __exit__(self, *exc) -> None:
        self.console.__exit__(*exc)


err_console = _StderrConsole()


def list_devices() -> None:
    """Print every known backend, usable or not (with the reason), to stdout."""
    for info in probe():
        state = "available" if info.available else f"unavailable: {info.reason}"
        typer.echo(f"{info.name:5s} {info.device} ({state})")


def check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise BadInput(f"{name} {v} must be positive")


def load_model(model: str | None, n_gpu_layers: int = 0, quiet: bool = False, threads: int | None = None,
               numerics: str = "llama", split: DeviceSplit | None = None,
               kv_types: tuple[DType, ...] = (DType.F16,), check_tensors: bool = False,
               poll: int | None = None) -> Model:
    """Resolve and load a model on the usable backends, its devices picked and shared as `split` (-dev,
    -sm, -ts, -mg) says, every tensor checked for NaN and infinity with check_tensors; a progress bar
    appears when loading is slow; the CPU's threads (-t) poll for work at level `poll` (--poll) when idle.
    The CPU kernels its graphs meet (with KV caches of `kv_types`) are
    compiled first where this machine has not compiled them yet."""
    if n_gpu_layers < 0:
        raise BadInput(f"-ngl {n_gpu_layers} must not be negative")
    if threads is not None and threads < 1:
        raise BadInput(f"-t {threads} must be positive")
    o.check_poll(poll)
    if numerics not in NUMERICS:
        raise BadInput(f"--numerics {numerics}: choose one of {', '.join(NUMERICS)}")
    set_threads(threads, poll)
    path = resolve_model(model)
    backends = usable_backends()
    if n_gpu_layers > 0 and len(backends) == 1:
        err_console.print("warning: no device backend is available; -ngl is ignored (see --list-devices)")
    bar = _LazyProgress(f"loading {path.name}", enabled=not quiet)
    try:
        m = Model.load(path, backends, n_gpu_layers, progress=bar.update, numerics=numerics, split=split,
                       check_tensors=check_tensors)
    finally:
        bar.close()
    compile_kernels(backends[-1], warm_tags(m, backends[-1], kv_types), quiet)
    library_patches.after_compiling()
    return m


def compile_kernels(cpu, tags: frozenset[str], quiet: bool = False) -> None:
    """Compile the CPU kernels a model with warm-up `tags` needs (core/backends/cpu/precompile.py) that this
    machine has not compiled yet, saying so with a progress bar; later runs find them in numba's cache
    and print nothing."""
    from ggrun.core.backends.cpu import precompile

    todo = precompile.pending(tags)
    if not todo:
        return
    t0 = time.perf_counter()
    if not quiet:
        err_console.print("ggrun: compiling the CPU kernels this model needs (once per machine; later runs load "
                          "them from the cache)")
    from rich.progress import BarColumn, Progress, TextColumn

    show = not quiet and sys.stderr.isatty()
    with Progress(TextColumn("compiling kernels"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  console=err_console, transient=True, disable=not show) as bar:
        task = bar.add_task("compile", total=len(todo))
        precompile.compile_warms(cpu, todo, lambda done, total: bar.update(task, completed=done, total=total),
                                 helpers=compile_jobs() - 1)
    if not quiet:
        err_console.print(f"ggrun: kernels compiled in {time.perf_counter() - t0:.1f} s")


def compile_jobs() -> int:
    """Processes that compile the CPU kernels at once: $GGRUN_COMPILE_JOBS, else the CPUs this process may
    use, up to 4 (the warm-up of one model has a few families of kernels to share out)."""
    from ggrun.core.backends.cpu.threads import usable_cpus

    value = os.environ.get("GGRUN_COMPILE_JOBS", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise BadInput(f"GGRUN_COMPILE_JOBS={value}: give a positive number of processes")
        return int(value)
    return min(usable_cpus(), 4)


class _LazyProgress:
    """A rich progress bar on stderr that only appears once the work has taken over a second."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.progress = None
        self.task = None

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.progress is None:
            if time.perf_counter() - self.t0 < 1.0:
                return
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TimeRemainingColumn(), console=err_console, transient=True)
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=total)
        self.progress.update(self.task, completed=done)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def timing_line(label: str, ms: float, count: int, unit: str) -> str:
    """llama.cpp's perf line: `label = X ms / N unit (Y ms per token, Z tokens per second)`."""
    per = ms / count if count else 0.0
    tps = 1e3 * count / ms if ms > 0 else 0.0
    return f"{label:>17s} = {ms:10.2f} ms / {count:5d} {unit:6s} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"


def print_model_info(session) -> None:
    """-v: what was loaded and where the memory went, on stderr."""
    m = session.model
    hp = m.hp
    lines = [
        f"model: {m.path.name}: {hp.arch}, {m.n_params / 1e6:.2f} M params, {m.file_bytes / 2**20:.2f} MiB in the file",
        f"hparams: n_layer {hp.n_layer}, n_embd {hp.n_embd}, n_head {hp.n_head}, n_head_kv {hp.n_head_kv}, "
        f"head_dim {hp.head_dim}, n_ff {hp.n_ff}, n_vocab {hp.n_vocab}, rope base {hp.rope_freq_base:g}",
        "weights: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" + (f" ({m.contexts[k].repacked / 2**20:.2f} MiB of it "
                                 "repacked for the kernels)" if m.contexts[k].repacked else "")
                                 for k, v in m.resident_bytes().items()),
        "KV cache: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in session.kv_bytes_by_backend().items()),
        "compute buffers: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in session.sched.buffer_sizes().items()),
    ]
    for line in lines:
        err_console.print(line, markup=False)
