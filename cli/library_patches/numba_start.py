"""Start-up work numba does in every process that ggrun's kernels do not need, skipped (a library patch:
applied by cli/library_patches' `apply`).

- numba imports PyYAML only to read a .numba_config.yaml in the working directory, which ggrun does not use
  (its numba settings come from the environment, core/backends/cpu/jit.py): PyYAML looks uninstalled while numba is first
  imported (`numba_without_yaml`; about 15 ms).
- Each of the ~140 kernels checks, as it is declared, that the cache directory exists and is writable,
  by creating a temporary file there; they share one directory, checked once per process (`install`).
- The first array a kernel is called with makes numba import numpy.ma, to refuse a masked array; an array
  cannot be one while numpy.ma was never imported, so it is imported only if it was (`install`; 10 ms).
- Before a kernel's first call, numba runs the entry points of installed numba extensions, which means
  importing importlib.metadata (15 ms) and scanning every installed package. They extend numba's compiler,
  which a cached kernel does not use; for ggrun's kernels this waits until something compiles (numba's
  compiler runs them then itself), and importlib.metadata is imported lazily, when first used.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def numba_without_yaml():
    """Within this, a first `import numba` does not import PyYAML."""
    hide = "yaml" not in sys.modules and "numba" not in sys.modules
    if hide:
        sys.modules["yaml"] = None  # import yaml: ImportError
        _import_lazily("importlib.metadata")
    try:
        yield
    finally:
        if hide and sys.modules.get("yaml", 0) is None:
            del sys.modules["yaml"]


def _import_lazily(name: str) -> None:
    """Module `name` in sys.modules as a module that runs when an attribute of it is first used."""
    import importlib.util

    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)


def install() -> None:
    """Check each cache directory once, and type arrays without importing numpy.ma (repeatable)."""
    import numpy as np
    from numba.core import caching, dispatcher
    from numba.core.typing import typeof

    if not getattr(caching._CacheLocator.ensure_cache_path, "checked_once", False):
        caching._CacheLocator.ensure_cache_path = _once_per_path(caching._CacheLocator.ensure_cache_path)
    numba_typeof = typeof.typeof_impl.dispatch(np.ndarray)
    if not getattr(numba_typeof, "without_numpy_ma", False):
        typeof.typeof_impl.register(np.ndarray)(_without_numpy_ma(numba_typeof))
    hook = dispatcher._DispatcherBase._compilation_chain_init_hook
    if not getattr(hook, "not_for_ggrun", False):
        dispatcher._DispatcherBase._compilation_chain_init_hook = _not_for_ggrun(hook)


def _not_for_ggrun(hook):
    def init_hook(self) -> None:
        if not self.py_func.__module__.startswith("ggrun."):
            hook(self)

    init_hook.not_for_ggrun = True
    return init_hook


def _once_per_path(ensure):
    checked: set[str] = set()

    def ensure_cache_path(self) -> None:
        path = self.get_cache_path()
        if path not in checked:
            ensure(self)
            checked.add(path)

    ensure_cache_path.checked_once = True
    return ensure_cache_path


def _without_numpy_ma(numba_typeof):
    def typeof_ndarray(val, c):
        if "numpy.ma" in sys.modules:  # then val may be a masked array, which numba refuses
            return numba_typeof(val, c)
        return _array_type(val)

    typeof_ndarray.without_numpy_ma = True
    return typeof_ndarray


def _array_type(val):
    """numba's type of a numpy array (its _typeof_ndarray, less the masked-array check)."""
    from numba.core import errors, types
    from numba.np import numpy_support

    try:
        dtype = numpy_support.from_dtype(val.dtype)
    except errors.NumbaNotImplementedError:
        raise errors.NumbaValueError(f"Unsupported array dtype: {val.dtype}") from None
    return types.Array(dtype, val.ndim, numpy_support.map_layout(val), readonly=not val.flags.writeable)
