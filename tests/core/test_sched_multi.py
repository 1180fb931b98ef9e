"""The scheduler over two backends (the stand-in device `sim` and the CPU), on small graphs
built by hand: where each node runs, how the graph is cut into splits, which tensors are
copied, that every backend's plan is valid, and that no backend reads another's memory.

Expected assignments are written out from the rules (a node reading a weight runs where
it lives, assignments spread to unassigned neighbours, refused ops fall back, views
follow their source, pins win), not read back from the scheduler.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.context import ImmediateContext
from ggrun.core.dtypes import DType
from ggrun.core.errors import GraphError, RuntimeFailure
from ggrun.core.graph import build_graph
from ggrun.core.ops import OPS
from ggrun.core.sched import ScheduledGraph, Scheduler
from ggrun.core.tensor import Tensor, new_tensor
from ggrun.core.validate import validate_plan

RNG = np.random.default_rng(7)
X = RNG.standard_normal((4, 8)).astype(np.float32)
W1 = (RNG.standard_normal((16, 8)) / 3).astype(np.float32)
W2 = (RNG.standard_normal((8, 16)) / 4).astype(np.float32)
W3 = (RNG.standard_normal((8, 8)) / 3).astype(np.float32)


def silu(a: np.ndarray) -> np.ndarray:
    return a / (1.0 + np.exp(-a))


def mlp_reference() -> np.ndarray:
    a1 = silu(X @ W1.T)
    a2 = silu(a1 @ W2.T)
    return a2 @ W3.T + X


class Rig:
    """A SIM device and the CPU, a weights context on each, and the CPU-side graph inputs."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.sim = SimBackend(refuse=frozenset(refuse))
        self.cpu = CPUBackend()
        self.on = {"SIM": ImmediateContext(self.sim), "CPU": ImmediateContext(self.cpu)}
        self.feeds: dict[Tensor, np.ndarray] = {}
        self.sched = Scheduler([self.sim, self.cpu])

    def weight(self, where: str, name: str, data: np.ndarray) -> Tensor:
        return self.on[where].from_array(name, data)

    def input(self, name: str, data: np.ndarray) -> Tensor:
        t = new_tensor(name, DType.F32 if data.dtype == np.float32 else DType.I32, data.shape, is_input=True)
        self.feeds[t] = data
        return t

    def schedule(self, *outs: Tensor, pins: dict | None = None) -> ScheduledGraph:
        return self.sched.schedule(build_graph(list(outs)), pins=pins)

    def run(self, sg: ScheduledGraph) -> list[np.ndarray]:
        self.sched.alloc(sg)
        for t, data in self.feeds.items():
            self.sched.set_tensor(t, data)
        self.sched.compute(sg)
        return [self.sched.get_tensor(o) for o in sg.graph.outputs]

    def mlp(self, w1: str = "CPU", w2: str = "SIM", w3: str = "CPU") -> dict[str, Tensor]:
        """x -> h1 = W1 x -> a1 = silu -> h2 = W2 a1 -> a2 = silu -> h3 = W3 a2 -> out = h3 + x."""
        x = self.input("x", X)
        h1 = ops.mul_mat(self.weight(w1, "w1", W1), x, name="h1")
        a1 = ops.silu(h1, name="a1")
        h2 = ops.mul_mat(self.weight(w2, "w2", W2), a1, name="h2")
        a2 = ops.silu(h2, name="a2")
        h3 = ops.mul_mat(self.weight(w3, "w3", W3), a2, name="h3")
        out = ops.add(h3, x, name="out")
        return dict(x=x, h1=h1, a1=a1, h2=h2, a2=a2, h3=h3, out=out)


def where(sg: ScheduledGraph) -> dict[str, str]:
    return {n.name: sg.backend_of[id(n)].name for n in sg.graph.nodes if n.op != "copy"}


def split_table(sg: ScheduledGraph) -> list[tuple[str, list[str], list[str]]]:
    """(backend, node names, names of the copied sources) per split."""
    return [(s.backend.name, [n.name for n in s.nodes], [c.srcs[0].name for c in s.copies]) for s in sg.splits]


def check_plans(rig: Rig, sg: ScheduledGraph) -> None:
    """validate_plan passes for every backend's plan; offsets honour the backend's alignment and
    every planned tensor lies in that backend's one compute buffer."""
    assert set(sg.plans) == {"SIM", "CPU"}
    for name, plan in sg.plans.items():
        validate_plan(sg.order, plan.offsets, plan.sizes, plan.scratch)
        backend = rig.sched.backend(name)
        buf = rig.sched.allocators[name].buffer
        for t, off in plan.offsets.items():
            assert off % backend.buffer_type.alignment == 0
            assert t.buffer is buf and buf.backend is backend


# ---- assignment, splits, copies ----------------------------------------------------------


def test_nodes_run_where_their_weights_live_and_assignments_spread_forward():
    rig = Rig()
    sg = rig.schedule(rig.mlp()["out"])
    # h1/h2/h3 read a weight: its backend; a1, a2, out read none: the node before them decides
    assert where(sg) == {"h1": "CPU", "a1": "CPU", "h2": "SIM", "a2": "SIM", "h3": "CPU", "out": "CPU"}
    assert split_table(sg) == [("CPU", ["h1", "a1"], []), ("SIM", ["h2", "a2"], ["a1"]),
                               ("CPU", ["h3", "out"], ["a2"])]
    assert sg.n_copies == 2 and sg.copy_bytes == 4 * 16 * 4 + 4 * 8 * 4
    # each split's copies come right before its first node in the execution order
    names = [t.name for t in sg.order]
    assert names == ["h1", "a1", "a1#copy", "h2", "a2", "a2#copy", "h3", "out"]
    # the consumers read the copies, which live on the consumer's backend
    h2 = sg.splits[1].nodes[0]
    assert h2.srcs[1].op == "copy" and sg.backend_of[id(h2.srcs[1])].name == "SIM"


def test_results_equal_the_reference_and_sim_counts_the_copied_bytes():
    rig = Rig()
    sg = rig.schedule(rig.mlp()["out"])
    rig.sim.reset_counters()  # w2 was copied in when it was created
    (out,) = rig.run(sg)
    np.testing.assert_allclose(out, mlp_reference(), rtol=1e-5, atol=1e-5)
    check_plans(rig, sg)
    assert (rig.sim.bytes_in, rig.sim.bytes_out) == (4 * 16 * 4, 4 * 8 * 4)
    rig.sched.compute(sg)  # copies run on every compute; weights never move again
    assert (rig.sim.bytes_in, rig.sim.bytes_out) == (2 * 4 * 16 * 4, 2 * 4 * 8 * 4)


def test_leading_unassigned_nodes_take_the_first_assigned_backend():
    rig = Rig()
    x = rig.input("x", X)
    s = ops.scale(x, 0.5, name="s")
    h = ops.mul_mat(rig.weight("SIM", "w", W3), s, name="h")
    sg = rig.schedule(h)
    assert where(sg) == {"s": "SIM", "h": "SIM"}
    assert split_table(sg) == [("SIM", ["s", "h"], ["x"])]
    (out,) = rig.run(sg)
    np.testing.assert_allclose(out, (0.5 * X) @ W3.T, rtol=1e-5, atol=1e-6)


def test_a_graph_without_weights_runs_on_the_cpu():
    rig = Rig()
    sg = rig.schedule(ops.silu(rig.input("x", X), name="y"))
    assert split_table(sg) == [("CPU", ["y"], [])]


def test_a_tensor_is_copied_once_per_backend_and_the_copy_serves_later_splits():
    rig = Rig()
    x = rig.input("x", X)
    h = ops.mul_mat(rig.weight("SIM", "wa", W3), x, name="h")
    c = ops.mul_mat(rig.weight("CPU", "wb", W3), h, name="c")
    d = ops.mul_mat(rig.weight("SIM", "wc", W3), c, name="d")
    e = ops.add(d, x, name="e")
    f = ops.add(e, x, name="f")
    sg = rig.schedule(f)
    assert split_table(sg) == [("SIM", ["h"], ["x"]), ("CPU", ["c"], ["h"]), ("SIM", ["d", "e", "f"], ["c"])]
    (out,) = rig.run(sg)
    check_plans(rig, sg)  # x's copy lives from the first SIM split to the last
    ref = ((X @ W3.T) @ W3.T) @ W3.T + 2 * X
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


# ---- fallback, views, pins ---------------------------------------------------------------


@pytest.mark.parametrize("refused", ["silu", "mul_mat"])
def test_a_refused_op_falls_back_to_the_cpu_with_copies_around_it(refused):
    rig = Rig(refuse=frozenset({refused}))
    sg = rig.schedule(rig.mlp()["out"])
    if refused == "silu":
        assert where(sg)["a2"] == "CPU"
        assert split_table(sg) == [("CPU", ["h1", "a1"], []), ("SIM", ["h2"], ["a1"]),
                                   ("CPU", ["a2", "h3", "out"], ["h2"])]
    else:  # h2 cannot run where w2 lives: the CPU runs it and copies the weight
        assert split_table(sg) == [("CPU", ["h1", "a1", "h2", "a2", "h3", "out"], ["w2"])]
    (out,) = rig.run(sg)
    np.testing.assert_allclose(out, mlp_reference(), rtol=1e-5, atol=1e-5)
    check_plans(rig, sg)
    for s in sg.splits:
        assert all(s.backend.supports_op(n) for n in s.nodes)


def test_fallback_takes_the_next_backend_in_priority_order():
    class Sim2(SimBackend):
        name = "SIM2"

    first, second, cpu = SimBackend(refuse=frozenset({"silu"})), Sim2(), CPUBackend()
    w = ImmediateContext(first).from_array("w", W3)
    x = new_tensor("x", DType.F32, X.shape, is_input=True)
    y = ops.silu(ops.mul_mat(w, x, name="h"), name="y")
    sg = Scheduler([first, second, cpu]).schedule(build_graph([y]))
    assert [(s.backend.name, [n.name for n in s.nodes]) for s in sg.splits] == [("SIM", ["h"]), ("SIM2", ["y"])]


def test_an_op_no_backend_runs_is_a_graph_error():
    class PickyCPU(CPUBackend):
        def supports_op(self, node):
            return node.op != "silu"

    sched = Scheduler([SimBackend(refuse=frozenset({"silu"})), PickyCPU()])
    y = ops.silu(new_tensor("x", DType.F32, X.shape, is_input=True), name="y")
    with pytest.raises(GraphError, match="no backend supports op silu"):
        sched.schedule(build_graph([y]))


def test_views_follow_their_source_and_a_foreign_view_is_copied_as_such():
    rig = Rig()
    x = rig.input("x", X)
    h = ops.mul_mat(rig.weight("SIM", "w", W1), x, name="h")  # SIM, [4, 16]
    ht = ops.permute(ops.reshape(h, (4, 2, 8), name="h3d"), (1, 0, 2), name="ht")  # views of h: SIM
    xt = ops.transpose(x, name="xt")  # a view of a CPU input: CPU
    y = ops.mul_mat(rig.weight("CPU", "v", W3), ht, name="y")  # CPU: reads the SIM view
    z = ops.mul_mat(rig.weight("CPU", "u", np.eye(4, dtype=np.float32)), xt, name="z")
    sg = rig.schedule(y, z)
    assert {k: v for k, v in where(sg).items() if k in ("h3d", "ht", "xt")} == {"h3d": "SIM", "ht": "SIM", "xt": "CPU"}
    assert sg.splits[1].backend.name == "CPU"
    (copy,) = sg.splits[1].copies
    assert copy.srcs[0] is ht and copy.shape == ht.shape and copy.is_contiguous and copy.nbytes == 2 * 4 * 8 * 4
    got_y, got_z = rig.run(sg)
    ref_ht = (X @ W1.T).reshape(4, 2, 8).transpose(1, 0, 2)
    np.testing.assert_allclose(got_y, ref_ht @ W3.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_z, X.T, rtol=0, atol=0)
    check_plans(rig, sg)


def test_a_pinned_node_runs_where_it_was_pinned():
    rig = Rig()
    t = rig.mlp()
    cpu, sim = rig.cpu, rig.sim
    sg = rig.schedule(t["out"], pins={"a1": sim, "h2": cpu})
    # a1 pinned to SIM; h2 pinned to the CPU although w2 lives on SIM: the weight is copied;
    # a2 reads no weight and follows h2
    assert where(sg) == {"h1": "CPU", "a1": "SIM", "h2": "CPU", "a2": "CPU", "h3": "CPU", "out": "CPU"}
    assert split_table(sg) == [("CPU", ["h1"], []), ("SIM", ["a1"], ["h1"]),
                               ("CPU", ["h2", "a2", "h3", "out"], ["w2", "a1"])]
    (out,) = rig.run(sg)
    np.testing.assert_allclose(out, mlp_reference(), rtol=1e-5, atol=1e-5)
    check_plans(rig, sg)


# ---- writes into placed memory (the KV cache) --------------------------------------------


def _cache_write(rig: Rig, src_on: str | None = None):
    """rows of a SIM cache written with set_rows, and a cpy of a (placed or computed) source into it."""
    cache = rig.on["SIM"].new_tensor("cache", DType.F32, (8, 8))
    rig.sim.set_tensor(cache, np.zeros((8, 8), np.float32))
    idx = rig.input("idx", np.array([5, 1, 6, 2], dtype=np.int32))
    rows = rig.input("rows", X)
    stored = ops.set_rows(cache, rows, idx, name="store")
    src = rig.weight(src_on, "src", W3) if src_on else ops.scale(rig.input("y", W3), 1.0, name="src")
    whole = ops.cpy(src, rig.on["SIM"].new_tensor("dst", DType.F32, (8, 8)), name="put")
    return cache, stored, whole


def test_a_write_into_device_memory_runs_on_the_device_even_from_a_cpu_source():
    rig = Rig()
    cache, stored, whole = _cache_write(rig, src_on="CPU")
    sg = rig.schedule(stored, whole)
    assert where(sg) == {"store": "SIM", "put": "SIM"}
    got_cache, got_whole = rig.run(sg)
    ref = np.zeros((8, 8), np.float32)
    ref[[5, 1, 6, 2]] = X
    np.testing.assert_array_equal(got_cache, ref)
    np.testing.assert_array_equal(got_whole, W3)
    check_plans(rig, sg)


@pytest.mark.parametrize("refused", ["set_rows", "cpy"])
def test_a_refused_write_into_device_memory_is_a_graph_error_not_a_silent_copy(refused):
    rig = Rig(refuse=frozenset({refused}))
    _, stored, whole = _cache_write(rig)
    with pytest.raises(GraphError, match=f"SIM cannot run {refused}"):
        rig.schedule(stored, whole)


def test_a_write_into_device_memory_cannot_be_pinned_elsewhere():
    rig = Rig()
    _, stored, _ = _cache_write(rig)
    with pytest.raises(GraphError, match="cannot be pinned to CPU"):
        rig.schedule(stored, pins={"store": rig.cpu})


# ---- memory ownership ----------------------------------------------------------------------


def test_an_unscheduled_cross_backend_read_fails_loudly():
    rig = Rig()
    sg = rig.schedule(rig.mlp()["out"])
    rig.sched.alloc(sg)
    for t, data in rig.feeds.items():
        rig.sched.set_tensor(t, data)
    # undo the copies: h2 now reads a1 in CPU memory, h3 reads a2 in SIM memory
    for s in sg.splits:
        for n in s.nodes:
            n.srcs = tuple(x.srcs[0] if x.op == "copy" else x for x in n.srcs)
        s.copies.clear()
    with pytest.raises(RuntimeFailure, match="SIM: tensor a1 .* lives on CPU; it must be copied"):
        rig.sched.compute(sg)


def test_each_backend_refuses_the_others_memory():
    rig = Rig()
    w_sim = rig.weight("SIM", "ws", W3)
    w_cpu = rig.weight("CPU", "wc", W3)
    for backend, foreign in ((rig.sim, w_cpu), (rig.cpu, w_sim)):
        for touch in (backend.array, backend.get_tensor, lambda t, b=backend: b.set_tensor(t, W3)):
            with pytest.raises(RuntimeFailure, match="must be copied"):
                touch(foreign)
        node = ops.scale(foreign, 2.0)
        node.place(backend.alloc_buffer(node.nbytes, "compute"), 0)
        with pytest.raises(RuntimeFailure, match="must be copied"):
            backend.compute([node])
    np.testing.assert_array_equal(rig.cpu.get_tensor(w_cpu), W3)
    np.testing.assert_array_equal(rig.sim.get_tensor(w_sim), W3)


def test_sim_copies_host_arrays_in_and_aligns_to_256():
    sim = SimBackend(refuse=frozenset())
    data = np.ones((3, 5), np.float32)
    t = ImmediateContext(sim).from_array("w", data)
    assert not np.shares_memory(sim.array(t), data)
    assert sim.bytes_in == data.nbytes
    assert sim.buffer_type.alignment == 256


# ---- pipeline slots and copy counts ------------------------------------------------------------


def test_pipeline_slots_give_each_compute_its_own_input_copies():
    """n_copies 3: every split input has three copies, each in bytes of its own for the whole graph;
    computes take the slots in turn, each writing this compute's inputs into its slot, and every one
    gives the reference result."""
    rig = Rig()
    rig.sched = Scheduler([rig.sim, rig.cpu], n_copies=3)
    sg = rig.schedule(rig.mlp()["out"])
    assert sg.n_slots == 3 and sg.n_copies == 2 and len(sg.persistent) == 6
    assert not any(c in sg.order for c in sg.persistent)  # planned as inputs, not in the walk
    rig.sched.alloc(sg)
    check_plans(rig, sg)
    assert len({(sg.backend_name(c), c.offset) for c in sg.persistent}) == 6  # no two slots share memory
    for k in range(4):
        scale = np.float32(k + 1)
        rig.sched.set_tensor(sg.graph.inputs()[0], X * scale)
        rig.sched.compute(sg)
        a1_copy = sg.slots[k % 3][id(sg.splits[1].copies[0])]
        a1 = silu(X * scale @ W1.T)
        np.testing.assert_allclose(rig.sim.array(a1_copy), a1, rtol=1e-5, atol=1e-6)
        want = silu(a1 @ W2.T) @ W3.T + X * scale
        np.testing.assert_allclose(rig.sched.get_tensor(sg.graph.outputs[0]), want, rtol=1e-5, atol=1e-5)
    assert list(rig.sched.slots_used) == [0, 1, 2, 0]
    assert sorted(sg.splits[1].slot_calls) == [1, 2]
    counts = {k: c.n for k, c in rig.sched.copy_counts.items()}
    assert counts == {"host->device": 4, "device->device": 0, "device->host": 4}


# ---- switches ------------------------------------------------------------------------------


def test_sched_debug_prints_each_split(monkeypatch, capsys):
    monkeypatch.setenv("GGRUN_SCHED_DEBUG", "1")
    rig = Rig()
    rig.schedule(rig.mlp()["out"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("sched:")]
    assert len(lines) == 4
    assert lines[0].startswith("sched: split 0: CPU nodes h1 .. a1 (2) copies 0")
    assert lines[1].startswith("sched: split 1: SIM nodes h2 .. a2 (2) copies 1 [256 bytes]: a1(256)")
    assert lines[2].startswith("sched: split 2: CPU nodes h3 .. out (2) copies 1 [128 bytes]: a2(128)")
    assert lines[3] == "sched: copies per compute: host->device 1 (256 bytes), device->host 1 (128 bytes)"


def test_sched_debug_off_prints_nothing(monkeypatch, capsys):
    monkeypatch.delenv("GGRUN_SCHED_DEBUG", raising=False)
    rig = Rig()
    rig.schedule(rig.mlp()["out"])
    assert "sched:" not in capsys.readouterr().err


def test_sim_refuse_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("GGRUN_SIM_REFUSE", "rope,soft_max")
    assert SimBackend().refuse == {"rope", "soft_max"}
    assert SimBackend(refuse=frozenset({"add"})).refuse == {"add"}
    monkeypatch.setenv("GGRUN_SIM_REFUSE", "")
    assert SimBackend().refuse == frozenset()


# ---- random graphs -------------------------------------------------------------------------

REFUSABLE = ("mul_mat", "silu", "add", "scale", "rms_norm", "cont", "mul")


@st.composite
def random_programs(draw):
    """A chain of steps over [4, 8] activations, each weight on a random backend."""
    steps = draw(st.lists(st.tuples(st.sampled_from(("matmul", "silu", "add", "scale", "norm", "perm", "mul")),
                                    st.sampled_from(("SIM", "CPU")), st.integers(0, 10**6)),
                          min_size=1, max_size=10))
    refuse = draw(st.frozensets(st.sampled_from(REFUSABLE), max_size=3))
    return steps, refuse


def _build_program(rig: Rig, steps) -> Tensor:
    x = rig.input("x", X)
    h, seen = x, [x]
    for i, (kind, on, seed) in enumerate(steps):
        data = np.random.default_rng(seed).standard_normal((8, 8)).astype(np.float32) / 3
        if kind == "matmul":
            h = ops.mul_mat(rig.weight(on, f"w{i}", data), h, name=f"n{i}")
        elif kind == "mul":
            h = ops.mul(h, rig.weight(on, f"g{i}", data[0]), name=f"n{i}")
        elif kind == "silu":
            h = ops.silu(h, name=f"n{i}")
        elif kind == "add":
            h = ops.add(h, seen[seed % len(seen)], name=f"n{i}")
        elif kind == "scale":
            h = ops.scale(h, 0.5, name=f"n{i}")
        elif kind == "norm":
            h = ops.rms_norm(h, 1e-5, name=f"n{i}")
        else:
            h = ops.cont(ops.reshape(ops.cont(ops.transpose(h)), (4, 8)), name=f"n{i}")
        seen.append(h)
    return h


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs())
def test_random_graphs_over_two_backends_equal_a_cpu_only_run(program):
    steps, refuse = program
    ref_rig = Rig()
    ref_sched = Scheduler([ref_rig.cpu])
    ref_out = _build_program(ref_rig, [(k, "CPU", s) for k, _, s in steps])
    ref_sg = ref_sched.schedule(build_graph([ref_out]))
    ref_rig.sched = ref_sched
    (ref,) = ref_rig.run(ref_sg)

    rig = Rig(refuse=refuse)
    sg = rig.schedule(_build_program(rig, steps))
    (got,) = rig.run(sg)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    check_plans(rig, sg)
    compute = [n for n in sg.graph.nodes if not OPS[n.op].view]
    # splits are the maximal runs of one backend; each copies exactly its foreign sources, once
    runs = 1 + sum(sg.backend_of[id(a)] is not sg.backend_of[id(b)] for a, b in zip(compute, compute[1:]))
    assert len(sg.splits) == runs
    for s in sg.splits:
        assert all(s.backend.supports_op(n) for n in s.nodes)
        assert len({id(c.srcs[0]) for c in s.copies}) == len(s.copies)
        for n in s.nodes:
            for src in n.srcs:
                assert sg.backend_name(src) == s.backend.name
