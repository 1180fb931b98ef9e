"""numba set-up for the CPU kernels: the on-disk compile cache under ggrun's cache directory
and the thread count (`-t`). Every compiled CPU kernel is declared with `kernel` from here.

Kernels compile once per machine (numba's `cache=True`); a later process loads them from disk.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """ggrun's cache: $GGRUN_CACHE, else ~/.cache/ggrun (the same place the model cache uses)."""
    env = os.environ.get("GGRUN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ggrun"


os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_root() / "numba"))

import numba  # noqa: E402  (the cache directory must be set before numba is imported)

_threads = 1


def kernel(*args, parallel: bool = False, **kw):
    """numba.njit with ggrun's defaults: cached on disk, no fast-math (ggml's CPU arithmetic)."""
    kw.setdefault("cache", True)
    kw.setdefault("nogil", True)
    return numba.njit(*args, parallel=parallel, **kw)


def set_threads(n: int | None) -> None:
    """Threads the compiled kernels (numba) and numpy's BLAS may use (llama.cpp's -t).

    None keeps the default: every core for numba, the library's default for BLAS. An
    oversubscribed machine makes multi-threaded kernels many times slower, so users need this.
    """
    global _threads
    if n is None:
        n = numba.config.NUMBA_NUM_THREADS
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    _threads = n
    numba.set_num_threads(n)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=n, user_api="blas")


def threads() -> int:
    return _threads
