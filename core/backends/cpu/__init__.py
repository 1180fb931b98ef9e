"""The CPU backend package: the backend, numba set-up, and compiled kernels by concern."""
import sys
from contextlib import contextmanager


@contextmanager
def _numba_without_yaml():
    """numba's config imports PyYAML only to read a .numba_config.yaml in the working directory, which
    ggrun does not use (its numba settings come from the environment, jit.py); PyYAML's import is about
    15 ms of every start. It looks uninstalled while the kernel modules first import numba."""
    hide = "yaml" not in sys.modules and "numba" not in sys.modules
    if hide:
        sys.modules["yaml"] = None  # import yaml: ImportError
    try:
        yield
    finally:
        if hide and sys.modules.get("yaml", 0) is None:
            del sys.modules["yaml"]


with _numba_without_yaml():
    from ggrun.core.backends.cpu.backend import CPUBackend
    from ggrun.core.backends.cpu.jit import set_threads

__all__ = ["CPUBackend", "set_threads"]
