"""The CPU backend package: the backend, numba set-up, and compiled kernels by concern."""
from core.backends.cpu.backend import CPUBackend
from core.backends.cpu.jit import set_threads

__all__ = ["CPUBackend", "set_threads"]
