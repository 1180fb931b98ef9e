"""The backends usable on this machine, in priority order (devices first, the CPU last),
each with a description, and for an unavailable one the reason.

This registry is ggrun's only global mutable state: backends are created once per process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from ggrun.core.backends.base import Backend
from ggrun.core.backends.cpu import CPUBackend


@dataclass
class BackendInfo:
    name: str
    device: str
    available: bool
    reason: str
    factory: Callable[[], Backend] | None


_instances: dict[str, Backend] = {}


def _cuda_info() -> BackendInfo:
    try:
        import cupy  # noqa: F401
    except Exception as err:
        return BackendInfo("CUDA", "NVIDIA GPU via cupy", False, f"cupy is not installed ({type(err).__name__})", None)
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        return BackendInfo("CUDA", "NVIDIA GPU via cupy", False, f"no usable GPU ({err})", None)
    if n < 1:
        return BackendInfo("CUDA", "NVIDIA GPU via cupy", False, "no GPU found", None)
    from ggrun.core.backends.cuda import CUDABackend, describe_device

    return BackendInfo("CUDA", describe_device(0), True, "", lambda: CUDABackend(0))


def _sim_info() -> BackendInfo:
    on = os.environ.get("GGRUN_SIM_DEVICE", "") not in ("", "0")
    from ggrun.core.backends.sim import SimBackend

    return BackendInfo("SIM", "stand-in device for tests (numpy kernels, own memory)", on,
                       "" if on else "set GGRUN_SIM_DEVICE=1 to enable", SimBackend if on else None)


def probe() -> list[BackendInfo]:
    """Every backend ggrun knows, available or not, in priority order."""
    cpu = BackendInfo("CPU", "host memory, numpy", True, "", CPUBackend)
    return [_cuda_info(), _sim_info(), cpu]


def usable_backends() -> list[Backend]:
    """Instances of the available backends, devices first, the CPU last."""
    out = []
    for info in probe():
        if info.available:
            if info.name not in _instances:
                _instances[info.name] = info.factory()
            out.append(_instances[info.name])
    return out
