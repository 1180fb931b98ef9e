"""`ggrun measure`: worst-case memory per backend for a model and configurations, from tensor
metadata alone (no weight data is read, no compute buffer is allocated); `--verify` runs
one worst-case micro-batch to prove the plan holds."""
from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.common import check_positive, err_console, list_devices
from ggrun.core.backends.registry import usable_backends
from ggrun.core.errors import BadInput
from ggrun.loaders.download import resolve_model
from ggrun.core.llm.memory import measure, verify
from ggrun.core.llm.model import Model

MiB = 2**20


def parse_int_list(text: str, flag: str) -> list[int]:
    """'512,2048' -> [512, 2048]; every value positive."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{flag} {text}: expected a comma-separated list of integers") from None
    if not values:
        raise BadInput(f"{flag}: no values given")
    check_positive(**{f"{flag} value": min(values)})
    return values


@app.command("measure")
def measure_command(
    model: o.Model = None,
    ctx_size: str = typer.Option("2048", "-c", "--ctx-size", help="Context sizes (comma list)"),
    batch_size: int = typer.Option(2048, "-b", "--batch-size", help="Logical batch size"),
    ubatch_size: str = typer.Option("512", "-ub", "--ubatch-size", help="Micro-batch sizes (comma list)"),
    n_parallel: int = typer.Option(1, "-np", "--parallel", help="Sequences sharing the KV cache"),
    n_gpu_layers: o.GpuLayers = 0,
    output: str = typer.Option("table", "-o", "--output", help="table or json"),
    verify_: bool = typer.Option(False, "--verify", help="Also run one worst-case micro-batch and check the plan held"),
    flash_attn: o.FlashAttn = True,
    list_devices_: o.ListDevices = False,
) -> None:
    """Plan worst-case memory per backend without running the model."""
    if list_devices_:
        list_devices()
        return
    ctxs = parse_int_list(ctx_size, "-c")
    ubs = parse_int_list(ubatch_size, "-ub")
    check_positive(**{"-b": batch_size, "-np": n_parallel})
    if n_gpu_layers < 0:
        raise BadInput(f"-ngl {n_gpu_layers} must not be negative")
    if output not in ("table", "json"):
        raise BadInput(f"-o {output}: choose table or json")
    path = resolve_model(model)
    m = Model.load(path, usable_backends(), n_gpu_layers, metadata_only=True)
    records = [r for c in ctxs for ub in ubs
               for r in measure(m, c, min(ub, batch_size), batch_size, n_parallel, flash_attn)]
    if output == "json":
        typer.echo(json.dumps([r.to_json() for r in records], indent=1))
    else:
        _print_table(m, records)
    if verify_:
        _verify(path, n_gpu_layers, ctxs, ubs, batch_size, flash_attn)


def _print_table(m: Model, records) -> None:
    t = Table(title=f"{m.path.name}: worst-case memory per backend (MiB)")
    for col in ("ctx", "ub", "logits", "backend", "weights file", "weights resident", "KV", "KV window", "output",
                "compute planned", "no reuse", "lower bound", "planned/lb", "nodes", "splits", "plan ms"):
        t.add_column(col, justify="right")
    for r in records:
        ratio = r.compute_planned_bytes / r.compute_lower_bound_bytes if r.compute_lower_bound_bytes else 1.0
        t.add_row(str(r.ctx), str(r.ubatch), r.logits, r.backend, f"{r.weights_file_bytes / MiB:.2f}",
                  f"{r.weights_resident_bytes / MiB:.2f}", f"{r.kv_bytes / MiB:.2f}",
                  f"{r.kv_swa_bytes / MiB:.2f}", f"{r.output_bytes / MiB:.2f}",
                  f"{r.compute_planned_bytes / MiB:.2f}", f"{r.compute_no_reuse_bytes / MiB:.2f}",
                  f"{r.compute_lower_bound_bytes / MiB:.2f}", f"{ratio:.4f}", str(r.nodes), str(r.splits),
                  f"{r.plan_ms:.1f}")
    Console(width=200).print(t)


def _verify(path, n_gpu_layers: int, ctxs: list[int], ubs: list[int], batch_size: int, flash_attn: bool) -> None:
    m = Model.load(path, usable_backends(), n_gpu_layers)
    for c in ctxs:
        for ub in ubs:
            rep = verify(m, c, min(ub, batch_size, c), flash_attn=flash_attn)
            err_console.print(f"verify ctx {c} ub {ub}: plan held ({rep.nodes_checked} node results checked "
                              f"in place; logits equal a run without reuse, max diff {rep.max_logit_diff:g})",
                              markup=False)
    sys.stderr.flush()
