"""`ggrun measure`: worst-case memory per backend for a model and configurations, from tensor
metadata alone (no weight data is read, no compute buffer is allocated); `--verify` runs
one worst-case micro-batch to prove the plan holds and that every backend's weights, KV cache and
compute buffer take what the table says.

Devices: -dev, -sm, -ts, -mg and -ngl mean what they mean for `ggrun run`, over this machine's devices.
`--plan-devices N` plans for N devices that need not exist here instead: N stand-in devices (SIM, or
SIM0..SIM{N-1}) that take no memory while measuring, so a split over GPUs one does not hold can be
planned (without -ts they share evenly: they all draw on the host's memory). A stand-in runs the
reference kernels, which need no work space: a CUDA device's compute buffer also holds its kernels'
scratch, so its figure there can be larger.
`--verify` with `--plan-devices` loads the model for real onto those stand-ins (host memory).

The table fits 100 columns: where the memory goes (weights as resident, KV cache, logits, compute
buffer) and their total; `-v` adds the planner's details (the weights' file bytes, the window cache,
the buffer without reuse and the lower bound, nodes, splits, planning time). `-o json` has everything.
"""
from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.common import check_positive, err_console, list_devices
from ggrun.cli.value_lists import int_values
from ggrun.core.backends.registry import sim_backends, usable_backends
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput, RuntimeFailure
from ggrun.core.llm.memory import MemoryRecord, figure_mismatches, measure, verify
from ggrun.core.llm.model import Model
from ggrun.loaders.download import resolve_model

MiB = 2**20
TABLE_WIDTH = 100


@app.command("measure")
def measure_command(
    model: o.Model = None,
    ctx_size: list[str] = typer.Option(["2048"], "-c", "--ctx-size", help="Context sizes (comma list, ranges as bench)"),
    batch_size: int = typer.Option(2048, "-b", "--batch-size", help="Logical batch size"),
    ubatch_size: list[str] = typer.Option(["512"], "-ub", "--ubatch-size", help="Micro-batch sizes (comma list)"),
    n_parallel: int = typer.Option(1, "-np", "--parallel", help="Sequences sharing the KV cache"),
    n_gpu_layers: o.GpuLayers = 0,
    device: o.Devices = None, split_mode: o.SplitMode = "layer", tensor_split: o.TensorSplit = None,
    main_gpu: o.MainGpu = 0,
    plan_devices: int = typer.Option(0, "--plan-devices", help="Plan for N stand-in devices instead of this machine's (named SIM, or SIM0..; see --help of measure)"),
    cache_type_k: o.CacheTypeK = DType.F16, cache_type_v: o.CacheTypeV = DType.F16,
    output: str = typer.Option("table", "-o", "--output", help="table or json"),
    verify_: bool = typer.Option(False, "--verify", help="Also run one worst-case micro-batch and check the plan held"),
    flash_attn: o.FlashAttnMode = "auto", no_flash_attn: o.NoFlashAttn = False,
    verbose: o.Verbose = False,
    list_devices_: o.ListDevices = False,
) -> None:
    """Plan worst-case memory per backend without running the model."""
    if list_devices_:
        list_devices()
        return
    ctxs = int_values(ctx_size, "-c", [], minimum=1)
    ubs = int_values(ubatch_size, "-ub", [], minimum=1)
    check_positive(**{"-b": batch_size, "-np": n_parallel})
    if output not in ("table", "json"):
        raise BadInput(f"-o {output}: choose table or json")
    if plan_devices < 0:
        raise BadInput(f"--plan-devices {plan_devices} must not be negative")
    fa = flash_attn != "off" and not no_flash_attn
    split = o.device_split(device, split_mode, tensor_split, main_gpu)
    path = resolve_model(model)
    backends = planning_backends(plan_devices)
    m = Model.load(path, backends, n_gpu_layers, metadata_only=True, split=split)
    records = [r for c in ctxs for ub in ubs
               for r in measure(m, c, min(ub, batch_size), batch_size, n_parallel, fa, cache_type_k, cache_type_v)]
    if output == "json":
        typer.echo(json.dumps([r.to_json() for r in records], indent=1))
    else:
        Console(width=TABLE_WIDTH if not verbose else 200).print(table(m.path.name, records, verbose))
    if verify_:
        real = Model.load(path, backends, n_gpu_layers, split=split)
        _verify(real, records, ctxs, ubs, batch_size, fa, n_parallel, cache_type_k, cache_type_v)


def planning_backends(n_devices: int) -> list:
    """This machine's backends, or with n_devices > 0, that many stand-in devices and this CPU."""
    backends = usable_backends()
    return sim_backends(n_devices) + [backends[-1]] if n_devices else backends


def table(name: str, records: list[MemoryRecord], verbose: bool = False) -> Table:
    """The memory table: one row per configuration and backend, in MiB; -v adds the planner's columns."""
    t = Table(title=f"{name}: worst-case memory per backend (MiB)")
    cols = ["ctx", "ub", "logits", "backend", "weights", "KV", "output", "compute", "total"]
    if verbose:
        cols += ["weights file", "KV window", "no reuse", "lower bound", "planned/lb", "nodes", "splits", "plan ms"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("logits", "backend") else "right")
    for r in records:
        total = r.weights_resident_bytes + r.kv_bytes + r.output_bytes + r.compute_planned_bytes
        cells = [str(r.ctx), str(r.ubatch), r.logits, r.backend, _mib(r.weights_resident_bytes), _mib(r.kv_bytes),
                 _mib(r.output_bytes), _mib(r.compute_planned_bytes), _mib(total)]
        if verbose:
            lb = r.compute_lower_bound_bytes
            cells += [_mib(r.weights_file_bytes), _mib(r.kv_swa_bytes), _mib(r.compute_no_reuse_bytes), _mib(lb),
                      f"{r.compute_planned_bytes / lb if lb else 1.0:.4f}", str(r.nodes), str(r.splits),
                      f"{r.plan_ms:.1f}"]
        t.add_row(*cells)
    return t


def _mib(n: int) -> str:
    return f"{n / MiB:.2f}"


def _verify(m: Model, records: list[MemoryRecord], ctxs: tuple[int, ...], ubs: tuple[int, ...], batch_size: int,
            flash_attn: bool, n_seq: int, type_k: DType, type_v: DType) -> None:
    """For each configuration: the plan held in a real run, and every backend took what `records` say
    (RuntimeFailure naming each difference)."""
    for c in ctxs:
        for ub in ubs:
            rep = verify(m, c, min(ub, batch_size, c), flash_attn=flash_attn, n_seq=n_seq, type_k=type_k,
                         type_v=type_v)
            mine = [r for r in records if r.ctx == c and r.ubatch == min(ub, batch_size, c)]
            wrong = figure_mismatches(mine, rep.taken)
            if wrong:
                raise RuntimeFailure(f"verify ctx {c} ub {ub}: " + "; ".join(wrong))
            taken = "; ".join(f"{name} weights {_mib(t.weights)}, KV {_mib(t.kv)}, compute {_mib(t.compute)} MiB"
                              for name, t in rep.taken.items())
            err_console.print(f"verify ctx {c} ub {min(ub, batch_size, c)}: plan held ({rep.nodes_checked} node results checked "
                              f"in place; logits equal a run without reuse, max diff {rep.max_logit_diff:g}); "
                              f"each backend took what was measured: {taken}", markup=False)
    sys.stderr.flush()
