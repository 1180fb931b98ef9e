"""Loading ggrun's kernels from numba's on-disk cache without numba's compiler set-up.

Before the first kernel a process calls, even one found in the cache, numba installs every typing and
lowering registry it has (importing much of numba: about 0.2 s, a tenth of ggrun's time to its first
token). Those registries serve compiling, and a cached kernel is machine code that is only loaded and
linked; what it does need at run time is numba's runtime (NRT, for arrays it allocates), which is set
up here. A kernel that is not in the cache is compiled as always, and numba's compiler installs the
registries itself then. Kernels of other packages load as numba loads them.
"""
from __future__ import annotations

from numba.core import caching
from numba.core.runtime import nrt

_numba_load = caching.Cache.load_overload


def skip_compiler_set_up() -> None:
    """Make numba load ggrun's cached kernels without its compiler set-up (for this process; repeatable).
    Where numba's cache lacks the internals this relies on, nothing changes."""
    if caching.Cache.load_overload is not _numba_load or not hasattr(caching.Cache, "_load_overload"):
        return
    caching.Cache.load_overload = _load_overload


def _load_overload(self, sig, target_context):
    """numba's Cache.load_overload less its target_context.refresh(), for functions of ggrun's modules."""
    if not self._py_func.__module__.startswith("ggrun."):
        return _numba_load(self, sig, target_context)
    if not nrt.rtsys._init:
        nrt.rtsys.initialize(target_context)
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)
