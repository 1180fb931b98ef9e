"""The plan validator: it accepts the allocator's plans and catches deliberately corrupted ones
(live tensors sharing bytes, an output overwritten later, a view outside its root)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from ggrun.core import ops
from ggrun.core.alloc import plan_graph
from ggrun.core.dtypes import DType
from ggrun.core.errors import RuntimeFailure
from ggrun.core.graph import build_graph
from ggrun.core.ops import OPS
from ggrun.core.tensor import Tensor, new_tensor
from ggrun.core.validate import validate_plan
from tests.core.random_graphs import ALIGN, Recipe, plan_of, recipes, schedule

ROW = 4 * 16 * 4  # bytes of one [4, 16] f32 tensor (a multiple of the alignment)


def _x() -> Tensor:
    return new_tensor("x", DType.F32, (4, 16), is_input=True)


def _graph(*outputs: Tensor):
    g = build_graph(list(outputs))
    plan = plan_graph(g.nodes, g.inputs(), lambda t: t.view_src is None, ALIGN)
    return g, dict(plan.offsets)


def test_accepts_the_allocators_plan():
    a = ops.scale(_x(), 2.0, name="a")
    b = ops.silu(a, name="b")  # in place over a
    c = ops.cont(ops.transpose(b), name="c")
    g, offsets = _graph(c)
    assert validate_plan(g.nodes, offsets) > 0


def test_accepts_dead_tensors_sharing_bytes():
    x = _x()
    a = ops.cont(x, name="a")
    b = ops.cont(a, name="b")
    c = ops.cont(b, name="c")  # a is dead once b exists
    g, _ = _graph(c)
    validate_plan(g.nodes, {x: 0, a: ROW, b: 0, c: ROW})


def test_detects_two_live_tensors_sharing_bytes():
    x = _x()
    a = ops.cont(x, name="a")
    b = ops.cont(x, name="b")
    c = ops.add(a, b, name="c")
    g, _ = _graph(c)
    with pytest.raises(RuntimeFailure, match=r"plan overlap: a .* b "):
        validate_plan(g.nodes, {x: 0, a: ROW, b: ROW, c: 2 * ROW})


def test_detects_a_partial_overlap():
    x = _x()
    a = ops.cont(x, name="a")
    b = ops.cont(x, name="b")
    c = ops.add(a, b, name="c")
    g, _ = _graph(c)
    with pytest.raises(RuntimeFailure, match="plan overlap"):
        validate_plan(g.nodes, {x: 0, a: ROW, b: 2 * ROW - 64, c: 3 * ROW})


def test_detects_an_output_overwritten_later():
    """`first` is read only by `mid`, but it is an output: `last` may not take its bytes."""
    x = _x()
    first = ops.cont(x, name="first")
    mid = ops.cont(first, name="mid")
    last = ops.cont(mid, name="last")
    g, _ = _graph(first, last)
    validate_plan(g.nodes, {x: 0, first: ROW, mid: 0, last: 2 * ROW})
    with pytest.raises(RuntimeFailure, match="first"):
        validate_plan(g.nodes, {x: 0, first: ROW, mid: 0, last: ROW})


def test_detects_the_root_of_an_output_view_overwritten_later():
    x = _x()
    a = ops.cont(x, name="a")
    v = ops.reshape(a, (64,), name="v")
    b = ops.scale(v, 2.0, name="b")
    later = ops.cont(b, name="later")
    g, _ = _graph(v, later)
    validate_plan(g.nodes, {x: 0, a: ROW, b: 0, later: 2 * ROW})
    with pytest.raises(RuntimeFailure, match=r"\ba\b.*later|later.*\ba\b"):
        validate_plan(g.nodes, {x: 0, a: ROW, b: 0, later: ROW})


def test_detects_a_root_overwritten_while_its_view_is_read():
    """a is read only through a view chain whose last reader, c, runs after b is born."""
    x = _x()
    a = ops.cont(x, name="a")
    v = ops.transpose(ops.transpose(a), name="v")
    b = ops.cont(x, name="b")
    c = ops.add(v, b, name="c")
    g, offsets = _graph(c)
    assert g.nodes.index(a) < g.nodes.index(b)
    validate_plan(g.nodes, offsets)
    offsets[b] = offsets[a]
    with pytest.raises(RuntimeFailure, match="plan overlap"):
        validate_plan(g.nodes, offsets)


def test_detects_a_view_outside_its_root():
    x = _x()
    v = ops.view(x, (2, 16), offset=2 * 16 * 4, name="bottom")
    c = ops.cont(v, name="c")
    g, offsets = _graph(c)
    validate_plan(g.nodes, offsets)
    v.view_offset = 3 * 16 * 4  # two rows starting at row 3 of a 4-row tensor
    with pytest.raises(RuntimeFailure, match="bottom.*outside x"):
        validate_plan(g.nodes, offsets)


def test_rejects_sharing_with_a_source_for_an_op_that_cannot_run_in_place():
    x = _x()
    a = ops.scale(x, 1.0, name="a")
    b = ops.cont(a, name="b")  # a copy: not an in-place op
    g, _ = _graph(b)
    with pytest.raises(RuntimeFailure, match="plan overlap"):
        validate_plan(g.nodes, {x: 0, a: ROW, b: ROW})


def test_rejects_in_place_over_a_source_that_is_read_later():
    x = _x()
    a = ops.scale(x, 1.0, name="a")
    b = ops.silu(a, name="b")
    c = ops.add(b, a, name="c")
    g, _ = _graph(c)
    with pytest.raises(RuntimeFailure, match="plan overlap"):
        validate_plan(g.nodes, {x: 0, a: ROW, b: ROW, c: 2 * ROW})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes())
def test_detects_a_node_placed_over_a_source_it_copies_from(recipe: Recipe):
    """Corrupt a valid random plan: put a node that cannot run in place at the bytes of an
    owned source it reads. The validator must name the pair."""
    _, sg, _ = schedule(recipe)
    plan = plan_of(sg)
    offsets = dict(plan.offsets)
    victims = [(n, s.root) for n in sg.order if n in offsets and not OPS[n.op].inplace
               for s in n.srcs if s.root in offsets and s.root is not n and s.root.nbytes > 0 and n.nbytes > 0]
    if not victims:
        return
    node, src = victims[0]
    offsets[node] = offsets[src]
    with pytest.raises(RuntimeFailure, match="plan overlap") as info:
        validate_plan(sg.order, offsets, plan.sizes)
    assert node.name in str(info.value) or src.name in str(info.value)
