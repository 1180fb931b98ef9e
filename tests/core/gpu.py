"""One skip rule for the CUDA tests: a test module calls `require_gpu()` before importing the CUDA
backend, and is skipped cleanly where cupy or a usable GPU is missing; `device_indices()` are the GPUs
a suite runs on, each in turn."""
from __future__ import annotations

import pytest


def require_gpu():
    """cupy, or a module-level skip saying why not."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no GPU", allow_module_level=True)
    except Exception as err:  # cupy without a driver
        pytest.skip(f"no usable GPU ({err})", allow_module_level=True)
    return cupy


def has_gpu() -> bool:
    """Whether cupy sees a usable GPU (no skip): for tests of what a machine without one does."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, or cupy without a driver
        return False


def device_indices() -> list[int]:
    """Every GPU's index (after require_gpu)."""
    import cupy

    return list(range(cupy.cuda.runtime.getDeviceCount()))
