"""What only the CPU backend's compiled kernels promise beyond the shared op cases (tests/core/op_cases.py,
run on every backend by test_backend_ops.py): results computed in place where the planner lets a node
take its source's memory, and attention split over threads giving the one-thread result bit for bit.
`bound_calls` says which nodes a compiled kernel took (test_kv_quant.py asks it too)."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, jit, set_threads
from ggrun.core.backends.kernels import KERNELS
from ggrun.core.dtypes import DType
from tests.core.backend_ops import compare, planned, run_on
from tests.core.op_cases import ATTENTION, ELEMENTWISE, attention_graph, values

F32 = DType.F32
rng = np.random.default_rng(20240607)


def bound_calls(build) -> dict[str, bool]:
    """For each compute node of the graph (by name): did a compiled kernel take it?"""
    backend = CPUBackend()
    _, sg, _, _ = planned(backend, build)
    calls = backend.prepare(sg.splits[0].nodes)
    return {n.name: not (isinstance(c, partial) and c.func in KERNELS.values()) for n, c in zip(sg.splits[0].nodes, calls)}


def check(build, threshold: float) -> None:
    """The CPU backend's result within threshold of the reference's, its output node compiled."""
    err = compare(CPUBackend(), build)
    assert err < threshold, err
    name, compiled = list(bound_calls(build).items())[-1]
    assert compiled, f"{name} fell back to the reference kernel"


def _inplace(build) -> list:
    _, sg, _, _ = planned(CPUBackend(), build)
    return sg.plans["CPU"].inplace


def test_rms_norm_mul_in_place():
    """When it is its source's last consumer, the result takes the source's memory: still right."""
    xd, wd = values(rng, 7, 576), values(rng, 576)

    def build(lf):
        x = ops.scale(lf.input("x", F32, xd), 2.0, name="x2")
        return ops.rms_norm_mul(x, lf.weight("w", F32, wd.shape, wd), 1e-5, name="normed")
    check(build, ELEMENTWISE["CPU"])
    assert any(n.name == "normed" and s.name == "x2" for n, s in _inplace(build))


def test_swiglu_in_place():
    gd, ud = values(rng, 7, 100, scale=4.0), values(rng, 7, 100)

    def build(lf):
        g = ops.scale(lf.input("g", F32, gd), 1.5, name="g")
        return ops.swiglu(g, lf.input("u", F32, ud), name="act")
    check(build, ELEMENTWISE["CPU"])
    assert any(n.name == "act" for n, _ in _inplace(build))


def test_flash_attn_on_several_threads():
    """The work shared by two threads (KV heads and blocks of tokens) gives the one-thread result,
    bitwise: a row's arithmetic never depends on how the work was split."""
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core")
    build = attention_graph(33, 9, 3, 64, 300, 300)(rng)
    one = run_on(CPUBackend(), build)
    before = jit.threads()
    try:
        set_threads(2)
        check(build, ATTENTION["CPU"])
        two = run_on(CPUBackend(), build)
    finally:
        set_threads(before)
    assert np.array_equal(two, one)
