"""Random graphs for allocator tests, built from a recipe of plain data so that the same graph
can be built twice (fresh tensors, same structure, same values).

A recipe draws from a pool of tensors: inputs first, then each step appends one tensor made
by an op on pool members. Steps mix element-wise chains (in-place candidates), views of
intermediates (reshape, transpose, strided windows), copies into views, matrix products
that change sizes, and tensors read by several consumers; some pool members become outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from ggrun.core import ops
from ggrun.core.alloc import Plan, plan_graph
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.dtypes import DType
from ggrun.core.graph import build_graph
from ggrun.core.sched import ScheduledGraph, Scheduler
from ggrun.core.tensor import Tensor, new_tensor
from tests.core.harness import Runner

N_KINDS = 10
ALIGN = CPUBackend.buffer_type.alignment


@dataclass(frozen=True)
class Recipe:
    rows: int
    cols: int
    seed: int
    steps: tuple[tuple[int, int, int, int], ...]  # (kind, operand pick, operand pick, variant)
    outputs: tuple[int, ...]  # picks of extra outputs (the last pool member is always one)


@st.composite
def recipes(draw, max_steps: int = 30) -> Recipe:
    big = st.integers(0, 1 << 20)
    n_steps = draw(st.integers(2, max_steps))  # uniform, so that long graphs are common
    steps = draw(st.lists(st.tuples(st.integers(0, N_KINDS - 1), big, big, big), min_size=n_steps, max_size=n_steps))
    return Recipe(
        rows=draw(st.integers(1, 8)),
        cols=draw(st.integers(1, 24)),
        seed=draw(st.integers(0, 1 << 16)),
        steps=tuple(steps),
        outputs=tuple(draw(st.lists(big, max_size=4))),
    )


@dataclass
class Built:
    outputs: list[Tensor]
    inputs: dict[Tensor, np.ndarray]
    pool: list[Tensor]


def build(recipe: Recipe, rt: Runner) -> Built:
    """Build the recipe's graph; weights go in rt's immediate context, inputs are returned with data."""
    rng = np.random.default_rng(recipe.seed)
    r, c = recipe.rows, recipe.cols
    x = new_tensor("x", DType.F32, (r, c), is_input=True)
    y = new_tensor("y", DType.F32, (c,), is_input=True)
    inputs = {x: rng.standard_normal((r, c)).astype(np.float32), y: rng.standard_normal(c).astype(np.float32)}
    pool: list[Tensor] = [x, y]

    def weight(shape: tuple[int, ...]) -> Tensor:
        return rt.weight(f"w{len(pool)}", rng.standard_normal(shape).astype(np.float32) * 0.5)

    for kind, i, j, variant in recipe.steps:
        a, b = _pick(pool, i), _pick(pool, j)
        pool.append(_step(kind, a, b, variant, weight))
    outs = [pool[-1]] + [pool[k % len(pool)] for k in recipe.outputs]
    outs = list(dict.fromkeys(t for t in outs if not t.is_input))  # inputs as outputs are not of interest here
    return Built(outputs=outs or [ops.scale(x, 1.0)], inputs=inputs, pool=pool)


def schedule(recipe: Recipe) -> tuple[Runner, ScheduledGraph, dict]:
    """Build the recipe's graph and schedule it on one CPU backend (nothing allocated yet)."""
    rt = Runner()
    built = build(recipe, rt)
    rt.feeds.update(built.inputs)
    rt.sched = Scheduler([rt.backend])
    rt.sg = rt.sched.schedule(build_graph(built.outputs))
    return rt, rt.sg, built.inputs


def plan_of(sg: ScheduledGraph) -> Plan:
    owned = sg.owned["CPU"]
    return plan_graph(sg.order, sg.graph.inputs(), lambda t: id(t) in owned, ALIGN)


def _pick(pool: list[Tensor], k: int) -> Tensor:
    """Mostly one of the last three members (so chains form and most steps stay reachable), at
    times any member (so some tensors get far-away consumers)."""
    if k % 4:
        return pool[-1 - k % 3 if len(pool) >= 3 else -1]
    return pool[k // 4 % len(pool)]


def _step(kind: int, a: Tensor, b: Tensor, variant: int, weight) -> Tensor:
    if kind == 0:  # element-wise unary: an in-place candidate
        unary = [lambda t: ops.scale(t, 0.5), ops.silu, ops.gelu, lambda t: ops.rms_norm(t, 1e-5),
                 lambda t: ops.norm(t, 1e-5), ops.soft_max]
        return unary[variant % len(unary)](a)
    if kind == 1:  # binary with broadcasting, possibly reading the same tensor twice
        op = ops.add if variant % 2 else ops.mul
        if ops._broadcasts(b.shape, a.shape):
            return op(a, b)
        return op(a, weight(a.shape[-1:]))
    if kind == 2:  # gated
        op = ops.swiglu if variant % 2 else ops.geglu
        return op(a, b) if a.shape == b.shape else op(a, ops.scale(a, -1.0))
    if kind == 3:  # reshape of a contiguous tensor
        if not a.is_contiguous:
            return ops.cont(a)
        n = a.n_elements
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        d = divisors[variant % len(divisors)]
        return ops.reshape(a, (n // d, d))
    if kind == 4:  # transpose: a non-contiguous view
        return ops.transpose(_as_2d(a))
    if kind == 5:  # a window of rows at an offset: a view that is smaller than its root
        if len(a.shape) != 2 or a.shape[0] < 2:
            return ops.cont(a)
        rows = a.shape[0] // 2
        start = variant % (a.shape[0] - rows + 1)
        return ops.view(a, (rows, a.shape[1]), strides=a.strides, offset=start * a.strides[0])
    if kind == 6:
        return ops.cont(a)
    if kind == 7:  # a product that changes the width
        width = (3, 8, 20)[variant % 3]
        return ops.mul_mat(weight((width, a.shape[-1])), _as_2d(a))
    if kind == 8:  # concat along the first axis when the rest matches
        other = b if b.shape[1:] == a.shape[1:] and b.dtype == a.dtype else a
        return ops.concat(a, other, 0)
    if kind == 9:  # copy into a view of an intermediate (a write that later readers see)
        if b.n_elements == a.n_elements and b.op is not None and b is not a and b.root is not a.root:
            return ops.cpy(a, b)
        return ops.cont(a)
    raise AssertionError(kind)


def _as_2d(a: Tensor) -> Tensor:
    if len(a.shape) >= 2:
        return a
    return ops.reshape(a if a.is_contiguous else ops.cont(a), (1, a.shape[0]))
