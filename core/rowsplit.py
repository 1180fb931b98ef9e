"""Matrices split by rows over several backends (llama.cpp's -sm row).

A *handle* stands for a whole [M, K] matrix and owns no memory; its parts, contiguous row ranges, are
ordinary weights on their backends. `ops.mul_mat` turns a product with a handle into one product per
part, each run where its part lives, and concatenates the partial results (columns in row order) on
the handle's main backend. Those are ordinary nodes: the scheduler copies the activations to each
part's backend and the partial results back, the allocator plans them, graph reuse keeps them.

A handle must never reach a graph itself: only mul_mat knows what it stands for.
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
    if len(parts) == 1:
        return ops.mul_mat(parts[0], b, name=name)
    out = ops.mul_mat(parts[0], b, name=f"{name}#0")
    for i, part in enumerate(parts[1:], 1):
        piece = ops.mul_mat(part, b, name=f"{name}#{i}")
        out = ops.concat(out, piece, axis=-1, name=name if i == len(parts) - 1 else f"{name}#cat{i}")
        out.params[RUN_ON] = a.params[GATHER_ON]
    return out
