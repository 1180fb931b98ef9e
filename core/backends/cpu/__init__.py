"""The CPU backend package: the backend, numba set-up, and compiled kernels by concern."""
from ggrun.core.backends.cpu import quick_start

with quick_start.numba_without_yaml():
    from ggrun.core.backends.cpu.jit import set_threads  # numba's set-up, then numba

    quick_start.install()  # before the kernel modules declare their kernels
    from ggrun.core.backends.cpu.backend import CPUBackend

__all__ = ["CPUBackend", "set_threads"]
