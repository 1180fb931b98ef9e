"""The CPU backend package: the backend, numba set-up, and compiled kernels by concern."""
from ggrun.core.backends.cpu.backend import CPUBackend
from ggrun.core.backends.cpu.jit import set_threads

__all__ = ["CPUBackend", "set_threads"]
