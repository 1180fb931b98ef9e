"""The graph allocator: its plans are valid, reuse memory and compute in place exactly when the
rules allow, are deterministic, and `measure` predicts what `alloc` uses; a reserved buffer
serves smaller graphs and a bigger graph re-reserves with a warning. Reuse never corrupts data.
"""
from __future__ import annotations

import logging

import numpy as np
from hypothesis import HealthCheck, given, settings

from ggrun.core import ops
from ggrun.core.alloc import FreeList, GraphAllocator, Plan, align_up, plan_graph
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.dtypes import DType
from ggrun.core.graph import build_graph
from ggrun.core.ops import OPS
from ggrun.core.sched import ScheduledGraph
from ggrun.core.tensor import Tensor, new_tensor
from ggrun.core.validate import validate_plan
from tests.core.harness import Runner
from tests.core.random_graphs import ALIGN, Recipe, plan_of, recipes, schedule

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def inplace_allowed(order: list[Tensor], owned: set[int]) -> set[tuple[int, int]]:
    """(node, source) pairs the rules allow to share memory, computed from the whole graph at
    once rather than with the allocator's running counters: the node's op computes in place,
    the source is its first source, an owned intermediate (not a view, input, weight or
    output) of the same size and dtype, read by no later node nor twice by this one, and no
    view of the source is still in use."""
    step = {id(n): i for i, n in enumerate(order)}
    reads: dict[int, list[int]] = {}
    views: dict[int, list[Tensor]] = {}
    for i, n in enumerate(order):
        for s in n.srcs:
            reads.setdefault(id(s), []).append(i)
        if n.view_src is not None:
            views.setdefault(id(n.view_src), []).append(n)

    def view_in_use_at(v: Tensor, i: int) -> bool:
        return v.is_output or max([step[id(v)]] + reads.get(id(v), [])) >= i

    allowed = set()
    for i, n in enumerate(order):
        if not OPS[n.op].inplace or n.view_src is not None or id(n) not in owned:
            continue
        s = n.srcs[0]
        if (id(s) in owned and s.op is not None and s.view_src is None
                and not (s.is_input or s.is_weight or s.is_output)
                and s.nbytes == n.nbytes and s.dtype == n.dtype
                and [k for k in reads[id(s)] if k >= i] == [i]
                and not any(view_in_use_at(v, i) for v in views.get(id(s), []))):
            allowed.add((id(n), id(s)))
    return allowed


# ---- properties on random graphs ----------------------------------------------------------

@SETTINGS
@given(recipes())
def test_random_plans_pass_the_validator(recipe: Recipe):
    _, sg, _ = schedule(recipe)
    plan = plan_of(sg)
    validate_plan(sg.order, plan.offsets, plan.sizes, plan.scratch)


@SETTINGS
@given(recipes())
def test_random_plans_place_every_owned_tensor_aligned(recipe: Recipe):
    _, sg, _ = schedule(recipe)
    plan = plan_of(sg)
    assert {id(t) for t in plan.offsets} == sg.owned["CPU"]
    for t, off in plan.offsets.items():
        assert off % ALIGN == 0
        assert off + t.nbytes <= plan.size, t.describe()


@SETTINGS
@given(recipes())
def test_inplace_happens_exactly_when_the_rules_allow(recipe: Recipe):
    _, sg, _ = schedule(recipe)
    plan = plan_of(sg)
    got = {(id(n), id(s)) for n, s in plan.inplace}
    assert got == inplace_allowed(sg.order, sg.owned["CPU"])
    for n, s in plan.inplace:
        assert plan.offsets[n] == plan.offsets[s]


@SETTINGS
@given(recipes())
def test_planned_size_lies_between_lower_bound_and_no_reuse(recipe: Recipe):
    _, sg, _ = schedule(recipe)
    plan = plan_of(sg)
    biggest = max(align_up(t.nbytes, ALIGN) for t in plan.offsets)
    assert biggest <= plan.lower_bound <= plan.size <= plan.no_reuse


@SETTINGS
@given(recipes())
def test_planning_twice_gives_identical_offsets(recipe: Recipe):
    _, sg, _ = schedule(recipe)
    assert plan_of(sg).offsets == plan_of(sg).offsets
    _, sg2, _ = schedule(recipe)  # the same graph built again from fresh tensors
    assert list(plan_of(sg).offsets.values()) == list(plan_of(sg2).offsets.values())


@SETTINGS
@given(recipes())
def test_measure_equals_what_alloc_uses(recipe: Recipe):
    rt, sg, _ = schedule(recipe)
    measured = rt.sched.measure(sg)["CPU"].size
    allocated = rt.sched.alloc(sg)["CPU"].size
    assert measured == allocated == rt.sched.buffer_sizes()["CPU"]


@SETTINGS
@given(recipes())
def test_plan_without_reuse_gives_every_tensor_its_own_bytes(recipe: Recipe):
    """reuse=False (the reference `ggrun measure --verify` runs against) shares nothing."""
    _, sg, _ = schedule(recipe)
    owned = sg.owned["CPU"]
    plan = plan_graph(sg.order, sg.graph.inputs(), lambda t: id(t) in owned, ALIGN, reuse=False)
    spans = sorted((off, off + plan.sizes[t]) for t, off in plan.offsets.items())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert plan.inplace == [] and plan.size == plan.no_reuse


def run_with_distinct_memory(recipe: Recipe) -> list[np.ndarray]:
    """The recipe's outputs computed with every owned tensor at its own bytes (no reuse, no in-place)."""
    rt, sg, inputs = schedule(recipe)
    owned = [t for t in sg.graph.inputs() + sg.order if id(t) in sg.owned["CPU"]]
    offsets = np.cumsum([0] + [align_up(t.nbytes, ALIGN) for t in owned])
    buf = rt.backend.alloc_buffer(int(offsets[-1]) + 1, usage="compute")
    for t, off in zip(owned, offsets):
        t.place(buf, int(off))
    return _compute(rt, sg, inputs)


def run_with_planned_memory(recipe: Recipe) -> list[np.ndarray]:
    rt, sg, inputs = schedule(recipe)
    rt.sched.alloc(sg)
    rt.sched.allocators["CPU"].buffer.storage[:] = 0xFF  # NaN garbage where nothing was written
    return _compute(rt, sg, inputs)


def _compute(rt: Runner, sg: ScheduledGraph, inputs: dict) -> list[np.ndarray]:
    for t, data in inputs.items():
        if t.buffer is not None:
            rt.sched.set_tensor(t, data)
    with np.errstate(all="ignore"):
        rt.sched.compute(sg)
    return [rt.sched.get_tensor(o) for o in sg.graph.outputs]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes(max_steps=40))
def test_reuse_never_corrupts_values(recipe: Recipe):
    """Outputs are the same whether intermediates share memory (as planned) or each has its own."""
    want = run_with_distinct_memory(recipe)
    got = run_with_planned_memory(recipe)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)


# ---- the in-place rules, one at a time ----------------------------------------------------

def _x(shape=(4, 16)) -> Tensor:
    return new_tensor("x", DType.F32, shape, is_input=True)


def _plan(*outputs: Tensor) -> Plan:
    g = build_graph(list(outputs))
    return plan_graph(g.nodes, g.inputs(), lambda t: t.buffer is None and t.view_src is None, ALIGN)


def _pairs(plan: Plan) -> list[tuple[str, str]]:
    return [(n.name, s.name) for n, s in plan.inplace]


def test_element_wise_chain_runs_in_place():
    a = ops.scale(_x(), 2.0, name="a")
    b = ops.silu(a, name="b")
    c = ops.rms_norm(b, 1e-5, name="c")
    plan = _plan(c)
    assert _pairs(plan) == [("b", "a"), ("c", "b")]
    assert plan.offsets[a] == plan.offsets[b] == plan.offsets[c]


def test_no_inplace_over_an_input():
    x = _x()
    b = ops.silu(x, name="b")
    assert _pairs(_plan(b)) == []


def test_no_inplace_over_a_weight():
    w = new_tensor("w", DType.F32, (4, 16), is_weight=True)
    w.buffer = object()  # a weight already has memory (it is not ours to plan)
    b = ops.silu(w, name="b")
    g = build_graph([b])
    plan = plan_graph(g.nodes, g.inputs(), lambda t: t.op is not None, ALIGN)
    assert plan.inplace == []


def test_no_inplace_over_a_source_with_another_consumer():
    a = ops.scale(_x(), 2.0, name="a")
    b = ops.silu(a, name="b")
    c = ops.add(b, a, name="c")  # a is read again after b
    assert ("b", "a") not in _pairs(_plan(c))


def test_no_inplace_over_a_source_read_twice_by_the_node():
    a = ops.scale(_x(), 2.0, name="a")
    b = ops.mul(a, a, name="b")
    assert _pairs(_plan(b)) == []


def test_no_inplace_over_a_source_with_a_live_view():
    a = ops.scale(_x(), 2.0, name="a")
    v = ops.reshape(a, (64,), name="v")
    b = ops.silu(a, name="b")
    c = ops.add(ops.reshape(b, (64,)), v, name="c")  # v is read after b
    assert ("b", "a") not in _pairs(_plan(c))


def test_inplace_once_the_view_is_done():
    a = ops.scale(_x(), 2.0, name="a")
    v = ops.cont(ops.reshape(a, (64,)), name="v")
    b = ops.silu(a, name="b")
    c = ops.add(v, ops.reshape(b, (64,)), name="c")  # the walk computes v (the first source) before b
    g = build_graph([c])
    assert g.nodes.index(v) < g.nodes.index(b)
    assert ("b", "a") in _pairs(_plan(c))


def test_no_inplace_over_an_output():
    a = ops.scale(_x(), 2.0, name="a")
    b = ops.silu(a, name="b")
    plan = _plan(a, b)
    assert plan.inplace == []
    assert plan.offsets[a] != plan.offsets[b]


def test_no_inplace_over_a_source_of_another_size():
    a = ops.mul_mat(new_tensor("w", DType.F32, (16, 16), is_input=True), _x(), name="a")
    b = ops.add(new_tensor("big", DType.F32, (2, 4, 16), is_input=True), a, name="b")
    assert _pairs(_plan(b)) == []


def test_no_inplace_for_ops_that_cannot():
    a = ops.scale(_x(), 2.0, name="a")
    b = ops.cont(a, name="b")
    assert _pairs(_plan(b)) == []


def test_inplace_only_over_the_first_source():
    """Kernels may alias only their first source: swiglu's `up` must not donate its memory
    (silu(gate) would be written over `up` before `up` is read)."""
    x = _x()
    gate = ops.scale(x, 1.0, name="gate")
    up = ops.scale(x, 2.0, name="up")
    sw = ops.swiglu(gate, up, name="sw")
    out = ops.add(sw, gate, name="out")  # gate lives on, so only up could donate
    assert ("sw", "up") not in _pairs(_plan(out))


# ---- memory reuse and outputs -------------------------------------------------------------

def test_dead_intermediates_are_reused():
    """A chain of copies needs two tensors' worth of memory, not one per node."""
    t = _x()
    for i in range(10):
        t = ops.cont(t, name=f"c{i}")
    plan = _plan(t)
    one = align_up(4 * 16 * 4, ALIGN)
    assert plan.no_reuse == 11 * one
    assert plan.size == plan.lower_bound == 2 * one


def test_outputs_are_never_overwritten():
    x = _x()
    first = ops.cont(x, name="first")
    t = first
    for i in range(4):
        t = ops.cont(t, name=f"c{i}")
    g = build_graph([first, t])
    plan = plan_graph(g.nodes, g.inputs(), lambda t: t.view_src is None, ALIGN)
    validate_plan(g.nodes, plan.offsets, plan.sizes)
    others = [n for n in g.nodes if n is not first]
    assert all(plan.offsets[n] != plan.offsets[first] for n in others)


def test_output_view_keeps_its_root_alive(rt: Runner):
    """An output that is a view of an intermediate, and is also read by later nodes, must
    survive to the end: its root's memory may not be reused."""
    xd = rt.random(4, 8)
    a = ops.scale(rt.input("x", xd), 3.0, name="a")
    v = ops.reshape(a, (32,), name="v")
    b = ops.scale(v, 2.0, name="b")
    later = ops.cont(b, name="later")  # wants memory of a's size just after a's last reader
    got_v, got_later = rt.run(v, later)
    np.testing.assert_allclose(got_v, 3 * xd.reshape(-1), rtol=1e-6)
    np.testing.assert_allclose(got_later, 6 * xd.reshape(-1), rtol=1e-6)
    plan = rt.sg.plans["CPU"]
    validate_plan(rt.sg.order, plan.offsets, plan.sizes, plan.scratch)


def test_inputs_are_placed_first():
    x = _x()
    y = new_tensor("y", DType.F32, (4, 16), is_input=True)
    c = ops.add(ops.cont(x), y)
    plan = _plan(c)
    assert list(plan.offsets)[:2] == [x, y]


# ---- reserving ----------------------------------------------------------------------------

def _chain(width: int, length: int = 3) -> list[Tensor]:
    t = new_tensor("x", DType.F32, (width,), is_input=True)
    for i in range(length):
        t = ops.cont(t)
    return build_graph([t]).nodes


def _owns(t: Tensor) -> bool:
    return t.view_src is None


def test_smaller_graph_reuses_the_reserved_buffer(caplog):
    alloc = GraphAllocator(CPUBackend())
    big = alloc.reserve(_chain(1000), [], _owns)
    buf = alloc.buffer
    assert alloc.reserves == 1 and alloc.reserved == big.size
    with caplog.at_level(logging.WARNING, logger="ggrun.alloc"):
        small = alloc.alloc(_chain(100), [], _owns)
    assert small.size < big.size
    assert alloc.buffer is buf and alloc.reserves == 1
    assert caplog.records == []


def test_bigger_graph_re_reserves_with_a_warning(caplog):
    alloc = GraphAllocator(CPUBackend())
    alloc.reserve(_chain(100), [], _owns)
    with caplog.at_level(logging.WARNING, logger="ggrun.alloc"):
        plan = alloc.alloc(_chain(1000), [], _owns)
    assert alloc.reserves == 2
    assert alloc.reserved == plan.size
    assert any("re-reserving" in r.getMessage() for r in caplog.records)


def test_alloc_places_tensors_in_the_reserved_buffer():
    alloc = GraphAllocator(CPUBackend())
    nodes = _chain(64)
    plan = alloc.alloc(nodes, [], _owns)
    for n in nodes:
        assert n.buffer is alloc.buffer and n.offset == plan.offsets[n]


def test_measure_allocates_nothing():
    backend = CPUBackend()
    alloc = GraphAllocator(backend)
    alloc.measure(_chain(64), [], _owns)
    assert alloc.buffer is None and alloc.reserves == 0


# ---- the free list ------------------------------------------------------------------------

def test_free_list_best_fit_and_coalescing():
    fl = FreeList()
    offs = [fl.alloc(n) for n in (64, 128, 64, 256)]
    assert offs == [0, 64, 192, 256] and fl.size == 512
    fl.free(64, 128)
    fl.free(256, 256)
    assert fl.alloc(64) == 64  # the smallest block that fits (128 at 64), not the first or largest
    fl.free(0, 64)
    fl.free(64, 64)  # coalesces with both neighbours: [0, 192)
    assert list(zip(fl.offsets, fl.sizes)) == [(0, 192), (256, 256)]


def test_free_list_extends_a_trailing_block_instead_of_leaving_a_gap():
    fl = FreeList()
    fl.alloc(64)
    fl.alloc(64)
    fl.free(64, 64)
    assert fl.alloc(192) == 64
    assert fl.size == 256


@settings(max_examples=60, deadline=None)
@given(recipes())
def test_free_list_blocks_never_overlap(recipe: Recipe):
    """After any plan the free blocks are sorted, disjoint, coalesced and inside the buffer."""
    _, sg, _ = schedule(recipe)
    owned = sg.owned["CPU"]
    seen: list[FreeList] = []
    orig_init = FreeList.__init__

    def spy(self):
        orig_init(self)
        seen.append(self)

    FreeList.__init__ = spy
    try:
        plan_graph(sg.order, sg.graph.inputs(), lambda t: id(t) in owned, ALIGN)
    finally:
        FreeList.__init__ = orig_init
    (fl,) = seen
    ends = [o + s for o, s in zip(fl.offsets, fl.sizes)]
    assert all(e < o for e, o in zip(ends, fl.offsets[1:]))
    assert all(e <= fl.size for e in ends)


# ---- the offline placement (tried when the walk's plan exceeds the lower bound) -----------

@SETTINGS
@given(recipes())
def test_offline_placement_passes_the_validator_and_never_grows_the_plan(recipe: Recipe):
    """Forced on every graph, the offline placement still yields valid plans, no larger than the walk's."""
    from ggrun.core import alloc

    _, sg, _ = schedule(recipe)
    walk = plan_of(sg)
    saved = alloc.OFFLINE_TRIGGER
    alloc.OFFLINE_TRIGGER = 0.0
    try:
        plan = plan_of(sg)
    finally:
        alloc.OFFLINE_TRIGGER = saved
    validate_plan(sg.order, plan.offsets, plan.sizes, plan.scratch)
    assert plan.lower_bound <= plan.size <= walk.size

