"""numba set-up for the CPU kernels: the on-disk compile cache under ggrun's cache directory and the
compile flags. Every compiled CPU kernel is declared with `kernel` from here; the thread count (`-t`)
lives in threads.py, and kernels ask it as jit.threads().

Kernels compile once per machine and instruction-set level (isa.py; numba's `cache=True`, in a
directory named by a digest of the sources other kernels inline, SHARED_SOURCES, and by the level, so
that code compiled for one level is never loaded under another); a later process loads them from disk.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ggrun.core.backends.cpu import isa
from ggrun.core.cache import cache_dir


# Files whose code kernels of other files compile in (helpers inlined across modules, and this
# file's compile flags). numba revalidates a cached kernel against its own source file only, so
# the cache lives in a directory named by a digest of these: editing one compiles afresh. (isa.py
# is not one: what a level compiles for is numba's target, which keys numba's own cache index.)
SHARED_SOURCES = ("jit.py", "vecmath.py", "norm.py", "kv_quant.py", "lut4.py", "sinks.py", "quant/codes.py",
                  "quant/activations.py", "quant/routing.py", "quant/decode.py", "quant/vec.py", "quant/layouts.py")


def sources_digest() -> str:
    digest = hashlib.sha256()
    for name in SHARED_SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:12]


isa.set_numba_target()
os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_dir() / "numba" / f"{sources_digest()}-{isa.LEVEL}"))

import numba  # noqa: E402

# numba reads NUMBA_CACHE_DIR when it is first imported; a program that imported it before ggrun would
# otherwise cache the kernels beside their sources (and the warm-up's marker in its working directory)
numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]

from ggrun.core.backends.cpu.threads import poll, set_threads, threads  # noqa: E402,F401  (kernels call jit.threads())


def kernel(*args, parallel: bool = False, **kw):
    """numba.njit with ggrun's defaults: cached on disk, no fast-math (ggml's CPU arithmetic), and
    C's division (x / 0 is inf or nan, as in ggml): Python's ZeroDivisionError check would put a
    branch in every division and keep such loops from vectorizing."""
    kw.setdefault("cache", True)
    kw.setdefault("nogil", True)
    kw.setdefault("error_model", "numpy")
    return numba.njit(*args, parallel=parallel, **kw)
