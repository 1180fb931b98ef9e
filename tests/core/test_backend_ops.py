"""Every op case (tests/core/op_cases.py) on every usable backend, against the reference kernels, as
llama.cpp's test-backend-ops runs its one case list on each backend: the CPU's compiled kernels, SIM (the
stand-in device: the numpy kernels in memory of their own, reached through copies) and each CUDA device
(CUDA0, CUDA1, ...; skipped where cupy or a GPU is missing). Where the case was written for the backend
(`native`), the backend's own kernels must also have taken it: a compiled CPU kernel for the output node,
no cupy fallback on CUDA; where it names a fused kernel's step (`fused`), CUDA must have run that step."""
from __future__ import annotations

from functools import partial

import pytest

from ggrun.core.backends.base import Backend
from ggrun.core.backends.kernels import KERNELS
from ggrun.core.backends.op_harness import compare, planned
from tests.core.op_cases import CASES, OpCase


def _cpu() -> Backend:
    from ggrun.core.backends.cpu import CPUBackend

    return CPUBackend()


def _sim() -> Backend:
    from ggrun.core.backends.sim import SimBackend

    return SimBackend()


def _cuda(index: int) -> Backend:
    from tests.core.gpu import require_gpu

    require_gpu()
    from ggrun.core.backends.cuda import CUDABackend

    return CUDABackend(index)


def _cuda_params() -> list:
    """CUDA0.. for each GPU, or one CUDA parameter that skips saying why (no cupy, no GPU)."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no cupy, or cupy without a driver: the parameter's backend skips
        count = 0
    return [pytest.param(partial(_cuda, i), id=f"CUDA{i}") for i in range(count)] or \
        [pytest.param(partial(_cuda, 0), id="CUDA")]


@pytest.fixture(scope="module", params=[pytest.param(_cpu, id="CPU"), pytest.param(_sim, id="SIM"), *_cuda_params()])
def backend(request) -> Backend:
    return request.param()


def kind(backend: Backend) -> str:
    """The backend's kind, as op cases name them: CPU, SIM or CUDA."""
    return "CUDA" if backend.name.startswith("CUDA") else "SIM" if backend.name.startswith("SIM") else backend.name


def cuda_steps(backend: Backend, build) -> list[str]:
    """The names of the steps a CUDA backend binds for the graph's nodes (a fused kernel's among them)."""
    _, sg, _, _ = planned(backend, build)
    return [s.name for s in backend.prepare(sg.splits[0].nodes).steps]


def fallbacks(backend: Backend, build) -> list[str]:
    """The nodes of the graph the backend's own kernels did not take: on the CPU, the output node if a
    reference kernel took it; on CUDA, every step but a cuBLAS call that cannot be captured (cupy's)."""
    _, sg, _, _ = planned(backend, build)
    nodes = sg.splits[0].nodes
    if kind(backend) == "CPU":
        call = backend.prepare(nodes)[-1]
        return [nodes[-1].name] if isinstance(call, partial) and call.func in KERNELS.values() else []
    if kind(backend) == "CUDA":
        return [s.name for s in backend.prepare(nodes).steps if not s.capturable and "cuBLAS" not in s.name]
    return []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_op(backend: Backend, case: OpCase):
    build = case.build()
    err = compare(backend, build)
    assert err < case.max_nmse(kind(backend)), err
    if kind(backend) in case.native:
        assert not fallbacks(backend, build), f"fell back to the reference kernels: {fallbacks(backend, build)}"
    if kind(backend) == "CUDA" and case.fused:
        assert case.fused in cuda_steps(backend, build), f"{case.fused} did not run: {cuda_steps(backend, build)}"
