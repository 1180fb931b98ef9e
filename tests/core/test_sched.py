"""The scheduler: backend assignment, splits, copies at split borders, one plan per backend,
and running a graph again (same plan, new inputs) or after its memory was planned anew.

A second backend is the SIM stand-in device: numpy kernels over its own arenas, which fails
loudly when a kernel would read another backend's memory.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.context import ImmediateContext
from ggrun.core.dtypes import DType
from ggrun.core.errors import GraphError
from ggrun.core.graph import build_graph
from ggrun.core.sched import Scheduler
from ggrun.core.tensor import Tensor, new_tensor
from ggrun.core.validate import validate_plan


class Model:
    """A small two-layer network: x -> silu(w1 x) -> norm -> w2 (.) -> softmax.

    w1 lives on `dev`, w2 on the CPU, so a scheduler over both must copy between them.
    """

    def __init__(self, dev, cpu, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.w1_data = rng.standard_normal((12, 8)).astype(np.float32)
        self.w2_data = rng.standard_normal((5, 12)).astype(np.float32)
        self.w1 = ImmediateContext(dev).from_array("w1", self.w1_data)
        self.w2 = ImmediateContext(cpu).from_array("w2", self.w2_data)
        self.x = new_tensor("x", DType.F32, (3, 8), is_input=True)
        h = ops.silu(ops.mul_mat(self.w1, self.x, name="h1"), name="act")
        h = ops.rms_norm(h, 1e-5, name="norm")
        self.out = ops.soft_max(ops.mul_mat(self.w2, h, name="h2"), name="probs")

    def reference(self, xd: np.ndarray) -> np.ndarray:
        h = xd.astype(np.float64) @ self.w1_data.T
        h = h / (1 + np.exp(-h))
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-5)
        z = h @ self.w2_data.T
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def _run(sched: Scheduler, sg, x: Tensor, xd: np.ndarray, out: Tensor) -> np.ndarray:
    sched.set_tensor(x, xd)
    sched.compute(sg)
    return sched.get_tensor(out)


def test_one_backend_makes_one_split_without_copies():
    cpu = CPUBackend()
    m = Model(cpu, cpu)
    sched = Scheduler([cpu])
    sg = sched.schedule(build_graph([m.out]))
    assert len(sg.splits) == 1 and sg.n_copies == 0
    assert sg.splits[0].nodes == build_graph([m.out]).compute_nodes()


def test_nodes_run_where_their_weights_live_with_copies_between():
    cpu, sim = CPUBackend(), SimBackend(refuse=frozenset())
    m = Model(sim, cpu)
    sched = Scheduler([sim, cpu])
    sg = sched.schedule(build_graph([m.out]))
    where = {n.name: sg.backend_name(n) for n in sg.order}
    assert where["h1"] == "SIM" and where["act"] == "SIM" and where["norm"] == "SIM"
    assert where["h2"] == "CPU" and where["probs"] == "CPU"
    assert [s.backend.name for s in sg.splits] == ["SIM", "CPU"]
    copied = [(c.srcs[0].name, s.backend.name) for s in sg.splits for c in s.copies]
    assert copied == [("x", "SIM"), ("norm", "CPU")]


def test_two_backends_compute_the_same_values_as_numpy():
    cpu, sim = CPUBackend(), SimBackend(refuse=frozenset())
    m = Model(sim, cpu)
    sched = Scheduler([sim, cpu])
    sg = sched.schedule(build_graph([m.out]))
    sched.alloc(sg)
    xd = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(sched, sg, m.x, xd, m.out), m.reference(xd), rtol=1e-5, atol=1e-6)


def test_each_backend_gets_a_valid_plan_in_its_own_buffer():
    cpu, sim = CPUBackend(), SimBackend(refuse=frozenset())
    m = Model(sim, cpu)
    sched = Scheduler([sim, cpu])
    sg = sched.schedule(build_graph([m.out]))
    measured = sched.measure(sg)
    plans = sched.alloc(sg)
    for name, plan in plans.items():
        validate_plan(sg.order, plan.offsets, plan.sizes, plan.scratch)
        assert measured[name].size == plan.size == sched.buffer_sizes()[name]
        backend = sched.backend(name)
        for t, off in plan.offsets.items():
            assert t.buffer.backend is backend
            assert off % backend.buffer_type.alignment == 0


def test_unsupported_op_falls_back_to_the_next_backend():
    cpu, sim = CPUBackend(), SimBackend(refuse=frozenset({"rms_norm"}))
    m = Model(sim, cpu)
    sched = Scheduler([sim, cpu])
    sg = sched.schedule(build_graph([m.out]))
    assert sg.backend_name(next(n for n in sg.order if n.name == "norm")) == "CPU"
    sched.alloc(sg)
    xd = np.ones((3, 8), dtype=np.float32)
    np.testing.assert_allclose(_run(sched, sg, m.x, xd, m.out), m.reference(xd), rtol=1e-5, atol=1e-6)


def test_a_pinned_node_runs_where_pinned():
    cpu, sim = CPUBackend(), SimBackend(refuse=frozenset())
    m = Model(sim, cpu)
    sched = Scheduler([sim, cpu])
    sg = sched.schedule(build_graph([m.out]), pins={"act": cpu})
    assert sg.backend_name(next(n for n in sg.order if n.name == "act")) == "CPU"
    sched.alloc(sg)
    xd = np.full((3, 8), 0.5, dtype=np.float32)
    np.testing.assert_allclose(_run(sched, sg, m.x, xd, m.out), m.reference(xd), rtol=1e-5, atol=1e-6)


def test_a_tensor_is_copied_once_per_backend():
    cpu, sim = CPUBackend(), SimBackend(refuse=frozenset())
    w = ImmediateContext(sim).from_array("w", np.eye(4, dtype=np.float32))
    x = new_tensor("x", DType.F32, (2, 4), is_input=True)
    a = ops.mul_mat(w, x, name="a")  # on SIM: x is copied there
    b = ops.mul_mat(w, ops.scale(x, 2.0), name="b")  # the scale spreads to SIM too
    sched = Scheduler([sim, cpu])
    sg = sched.schedule(build_graph([ops.add(a, b)]))
    copies = [c for s in sg.splits for c in s.copies]
    assert [c.srcs[0].name for c in copies] == ["x"]


def test_leaf_without_memory_that_is_not_an_input_is_refused():
    stray = new_tensor("stray", DType.F32, (2, 2))
    with pytest.raises(GraphError, match="stray"):
        Scheduler([CPUBackend()]).schedule(build_graph([ops.silu(stray)]))


def test_compute_again_with_new_inputs_reuses_the_plan():
    """Graph reuse: the same scheduled graph serves several inputs without being planned again."""
    cpu = CPUBackend()
    m = Model(cpu, cpu)
    sched = Scheduler([cpu])
    sg = sched.schedule(build_graph([m.out]))
    sched.alloc(sg)
    rng = np.random.default_rng(2)
    for _ in range(3):
        xd = rng.standard_normal((3, 8)).astype(np.float32)
        np.testing.assert_allclose(_run(sched, sg, m.x, xd, m.out), m.reference(xd), rtol=1e-5, atol=1e-6)
    assert sched.allocators["CPU"].reserves == 1


def test_graph_planned_again_into_a_new_buffer_reads_its_new_memory():
    """After reset() the same graph is planned into a fresh buffer; every array over the old
    buffer (views included) must be dropped, or kernels would read stale memory."""
    cpu = CPUBackend()
    x = new_tensor("x", DType.F32, (4, 6), is_input=True)
    a = ops.scale(x, 3.0, name="a")
    out = ops.cont(ops.transpose(a), name="out")
    sched = Scheduler([cpu])
    sg = sched.schedule(build_graph([out]))
    xd = np.arange(24, dtype=np.float32).reshape(4, 6)
    sched.alloc(sg)
    np.testing.assert_array_equal(_run(sched, sg, x, xd, out), 3 * xd.T)
    sched.reset()
    sched.alloc(sg)
    np.testing.assert_array_equal(_run(sched, sg, x, 2 * xd, out), 6 * xd.T)


def test_reset_drops_the_buffers():
    cpu = CPUBackend()
    m = Model(cpu, cpu)
    sched = Scheduler([cpu])
    sg = sched.schedule(build_graph([m.out]))
    sched.alloc(sg)
    assert sched.buffer_sizes()["CPU"] > 0
    sched.reset()
    assert sched.buffer_sizes()["CPU"] == 0 and sched.generation == 1
