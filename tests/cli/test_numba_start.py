"""numba start-up work skipped (cli/library_patches/numba_start.py): arrays get numba's own types, masked
arrays are still refused, and a cache directory is checked once per process."""
from __future__ import annotations

import numpy as np
import pytest
from numba.core import caching, errors
from numba.core.typing import typeof

from ggrun.cli.library_patches import numba_start as quick_start  # installed by tests/conftest.py

ARRAYS = [np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float16, order="F"), np.arange(9, dtype=np.int32)[::2],
          np.zeros((4, 4, 2), np.uint8)[:, 1], np.frombuffer(b"\0" * 16, np.uint8)]


@pytest.mark.parametrize("arr", ARRAYS, ids=lambda a: f"{a.dtype}-{a.ndim}d")
def test_arrays_get_numbas_types(arr):
    numbas = typeof._typeof_ndarray(arr, None)  # numba's own typing of arrays, which quick_start replaces
    assert typeof.typeof(arr) == quick_start._array_type(arr) == numbas


def test_masked_arrays_are_still_refused():
    import numpy.ma

    with pytest.raises(errors.NumbaTypeError, match="MaskedArray"):
        typeof.typeof(numpy.ma.array([1, 2]))


def test_a_cache_directory_is_checked_once(tmp_path, monkeypatch):
    calls = []

    class Locator:
        def get_cache_path(self):
            return str(tmp_path)

    ensure = quick_start._once_per_path(lambda self: calls.append(self.get_cache_path()))
    for _ in range(3):
        ensure(Locator())
    assert calls == [str(tmp_path)]
    assert getattr(caching._CacheLocator.ensure_cache_path, "checked_once", False)


def test_extension_entry_points_wait_for_a_compilation_of_ggruns_kernels():
    """numba's extensions are initialized before another package's kernel first runs, not before one of
    ggrun's (a cached kernel does not compile); a ggrun kernel that compiles still works."""
    import numba

    calls = []
    hook = quick_start._not_for_ggrun(lambda self: calls.append(self.py_func.__module__))
    for module in ("ggrun.core.backends.cpu.quant", "theirs"):
        hook(type("Dispatcher", (), {"py_func": type("F", (), {"__module__": module})})())
    assert calls == ["theirs"]
    ns = {"__name__": "ggrun.tests_kernel"}
    exec("def plus_one(x):\n    return x + 1\n", ns)
    assert numba.njit(ns["plus_one"])(41) == 42
