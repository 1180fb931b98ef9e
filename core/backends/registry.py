"""The backends usable on this machine, in priority order (devices first, the CPU last),
each with a description, and for an unavailable one the reason.

Every GPU is a backend of its own, named as llama.cpp names it (CUDA0, CUDA1, ...), and so is
every stand-in device GGRUN_SIM_DEVICE asks for (=1: one, `SIM`; =N: SIM0..SIM{N-1}).

This registry is ggrun's only global mutable state: backends are created once per process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from ggrun.core.backends.base import Backend
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.errors import DeviceFailure

SIM_DESCRIPTION = "stand-in device for tests (numpy kernels, own memory)"


@dataclass
class BackendInfo:
    name: str
    device: str
    available: bool
    reason: str
    factory: Callable[[], Backend] | None


_instances: dict[str, Backend] = {}


def _cuda_infos() -> list[BackendInfo]:
    """One entry per GPU (CUDA0, CUDA1, ...), or one unavailable `CUDA` entry saying why there is none."""
    try:
        import cupy  # noqa: F401
    except Exception as err:
        return [BackendInfo("CUDA", "NVIDIA GPU via cupy", False, f"cupy is not installed ({type(err).__name__})",
                            None)]
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        return [BackendInfo("CUDA", "NVIDIA GPU via cupy", False, f"no usable GPU ({err})", None)]
    if n < 1:
        return [BackendInfo("CUDA", "NVIDIA GPU via cupy", False, "no GPU found", None)]
    from ggrun.core.backends.cuda import CUDABackend, describe_device
    from ggrun.core.backends.cuda.backend import DEVICE_ERRORS

    infos = []
    for i in range(n):
        try:
            desc = describe_device(i)
        except DEVICE_ERRORS as err:  # a GPU that cannot even say what it is: one line naming it
            raise DeviceFailure(f"CUDA{i}", f"{type(err).__name__}: {err}") from err
        infos.append(BackendInfo(f"CUDA{i}", desc, True, "", lambda i=i: CUDABackend(i)))
    return infos


def sim_count() -> int:
    """Stand-in devices GGRUN_SIM_DEVICE asks for: none when unset, empty or 0; N for a number N;
    one for any other value (`yes`)."""
    raw = os.environ.get("GGRUN_SIM_DEVICE", "").strip()
    if raw in ("", "0"):
        return 0
    try:
        return max(int(raw), 0)
    except ValueError:
        return 1


def sim_names(n: int) -> list[str]:
    """`SIM` for one stand-in device (the name tests and scripts have always used), SIM0.. for several."""
    return ["SIM"] if n == 1 else [f"SIM{i}" for i in range(n)]


def sim_backends(n: int) -> list[Backend]:
    """n fresh stand-in devices, named as the registry names them (for planning without the registry)."""
    from ggrun.core.backends.sim import SimBackend

    return [SimBackend(name=name) for name in sim_names(n)]


def _sim_infos() -> list[BackendInfo]:
    n = sim_count()
    if n == 0:
        return [BackendInfo("SIM", SIM_DESCRIPTION, False, "set GGRUN_SIM_DEVICE=1 to enable", None)]
    from ggrun.core.backends.sim import SimBackend

    return [BackendInfo(name, SIM_DESCRIPTION, True, "", lambda name=name: SimBackend(name=name))
            for name in sim_names(n)]


def probe() -> list[BackendInfo]:
    """Every backend ggrun knows, available or not, in priority order."""
    cpu = BackendInfo("CPU", "host memory, numpy", True, "", CPUBackend)
    return [*_cuda_infos(), *_sim_infos(), cpu]


def usable_backends() -> list[Backend]:
    """Instances of the available backends, devices first, the CPU last."""
    out = []
    for info in probe():
        if info.available:
            if info.name not in _instances:
                _instances[info.name] = info.factory()
            out.append(_instances[info.name])
    return out
