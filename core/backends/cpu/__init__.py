"""The CPU backend package: the backend, numba set-up, and compiled kernels by concern.

CPUBackend and set_threads are imported when first asked for, so that importing one module of the
package (jit, numba's set-up: cli/library_patches does so before patching numba) declares no kernel;
the instruction-set level (isa.py, no numba) is checked on import, as before.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ggrun.core.backends.cpu import isa  # noqa: F401  (the level: a bad GGRUN_CPU_ISA ends the process here, exit 2)

if TYPE_CHECKING:
    from ggrun.core.backends.cpu.backend import CPUBackend
    from ggrun.core.backends.cpu.jit import set_threads

__all__ = ["CPUBackend", "set_threads"]


def __getattr__(name: str):
    if name == "CPUBackend":
        from ggrun.core.backends.cpu.backend import CPUBackend

        return CPUBackend
    if name == "set_threads":
        from ggrun.core.backends.cpu.jit import set_threads

        return set_threads
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
