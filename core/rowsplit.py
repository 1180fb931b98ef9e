"""Matrices split by rows over several backends (llama.cpp's -sm row).

A *handle* stands for a whole [M, K] matrix and owns no memory; its parts, contiguous row ranges, are
ordinary weights on their backends. `ops.mul_mat` turns a product with a handle into one product per
part, each run where its part lives, and concatenates the partial results (columns in row order) on
the handle's main backend. Those are ordinary nodes: the scheduler copies the activations to each
part's backend and the partial results back, the allocator plans them, graph reuse keeps them.

Where one activation meets several split matrices (q, k and v; a gated feed-forward's gate and up), each
device computes its parts of all of them in one node (`products`, `mul_mat_glu`), so that a device is
visited once per activation rather than once per matrix, and only the results are gathered.

A handle must never reach a graph itself: only mul_mat (and the two above) know what it stands for.
"""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor, new_tensor

ROW_PARTS = "row_parts"  # a handle's params: its parts, in row order
GATHER_ON = "gather_on"  # a handle's params: the backend (by name) that gathers the partial products
RUN_ON = "run_on"  # a node's params: the backend (by name) the scheduler must run it on


def handle(name: str, dtype: DType, shape: tuple[int, ...], parts: list[Tensor], gather_on: str) -> Tensor:
    """The stand-in for matrix `name` whose rows are `parts` (in order; their rows add up to shape[0])."""
    if sum(p.shape[0] for p in parts) != shape[0] or any(p.shape[1:] != tuple(shape[1:]) for p in parts):
        raise ValueError(f"{name}: parts {[p.shape for p in parts]} do not make up {list(shape)}")
    t = new_tensor(name, dtype, shape, is_weight=True)
    t.params[ROW_PARTS] = tuple(parts)
    t.params[GATHER_ON] = gather_on
    for key in ("act_quant",):
        if key in parts[0].params:
            t.params[key] = parts[0].params[key]
    return t


def is_split(t: Tensor) -> bool:
    return ROW_PARTS in t.params


def mul_mat_rows(a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
    """mul_mat(a, b) for a handle a: b @ part^T for each part (where the part lives), joined along the
    last axis by concat nodes that run on a's gathering backend; the last one is named `name`."""
    name = name or f"{a.name}@mul_mat"
    parts = a.params[ROW_PARTS]
    return gather([ops.mul_mat(part, b, name=f"{name}#{i}") for i, part in enumerate(parts)], name,
                  a.params[GATHER_ON])


def gather(pieces: list[Tensor], name: str, on: str) -> Tensor:
    """Partial products [N, M_i] (in row order) joined along the last axis by concat nodes that run on backend
    `on`; the last is named `name` (one piece: itself)."""
    out = pieces[0]
    for i, piece in enumerate(pieces[1:], 1):
        out = ops.concat(out, piece, axis=-1, name=name if i == len(pieces) - 1 else f"{name}#cat{i}")
        out.params[RUN_ON] = on
    return out


def _by_device(ws: tuple[Tensor, ...]) -> list[tuple[Tensor, ...]] | None:
    """The parts of handles ws grouped by device (device d: each handle's d-th part), where every handle is
    split over the same backends in the same order; else None."""
    if not ws or not all(is_split(w) for w in ws):
        return None
    parts = [w.params[ROW_PARTS] for w in ws]
    homes = [tuple(_backend(p) for p in ps) for ps in parts]
    if None in homes[0] or any(h != homes[0] for h in homes) or any(w.params[GATHER_ON] != ws[0].params[GATHER_ON]
                                                                     for w in ws):
        return None
    return [tuple(ps[d] for ps in parts) for d in range(len(parts[0]))]


def _backend(t: Tensor):
    return t.root.buffer.backend if t.root.buffer is not None else None


def products(ws: tuple[Tensor, ...], x: Tensor, names: tuple[str, ...], name: str) -> list[Tensor] | None:
    """x through each handle of ws (attention's q, k and v): one mul_mat_multi node per device over its parts
    of every weight, so that each device is visited once for all of them, then each product gathered on
    the main device as `names`. None unless ws are handles split alike over devices that run mul_mat_multi."""
    groups = _by_device(ws)
    if groups is None:
        return None
    per_device = []
    for d, group in enumerate(groups):
        views = ops.mul_mat_multi(group, x, tuple(f"{n}#{d}" for n in names), name=f"{name}#{d}")
        if not _backend(group[0]).supports_op(views[0].view_src):
            return None
        per_device.append(views)
    on = ws[0].params[GATHER_ON]
    return [gather([views[i] for views in per_device], n, on) for i, n in enumerate(names)]


def mul_mat_glu(gate: Tensor, up: Tensor, x: Tensor, glu: str, f16_table: bool, name: str) -> Tensor | None:
    """glu(x gate^T, x up^T) for handles gate and up split alike: the gated product of each device's rows
    there (the gate's and the up's rows pair up element by element), the results gathered on the main
    device; None where they are not split alike or a device cannot run mul_mat_glu."""
    groups = _by_device((gate, up))
    if groups is None:
        return None
    pieces = []
    for d, (g, u) in enumerate(groups):
        if g.shape != u.shape:
            return None
        piece = ops.mul_mat_glu(g, u, x, glu, f16_table, name=f"{name}#{d}")
        if not _backend(g).supports_op(piece):
            return None
        pieces.append(piece)
    return gather(pieces, name, gate.params[GATHER_ON])
