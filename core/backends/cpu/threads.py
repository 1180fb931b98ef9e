"""How many threads the compiled kernels and numpy's BLAS use (llama.cpp's -t), and how idle ones wait.

The default is llama.cpp's: one thread per physical core (common_cpu_get_num_math: hyper-threads do not
help linear algebra), counted from Linux's CPU topology, and here never more than the CPUs this process
may run on.

Idle threads sleep instead of spinning. A spinning thread holds its core; on a machine shared with
other work, the partner it waits for then sits behind the other work until a scheduler slice ends, and
every parallel kernel waits that long: ggrun at -t 2 ran 26-90 times slower than at -t 1 beside busy
processes, where with sleeping waiters it runs as fast as -t 1 (scripts/bench/bench_threads.py measures this).
OpenMP (numba's threading layer) reads its wait policy when numba starts its threads, after this module
is imported (jit imports it before any kernel exists), so the default is set here; OpenBLAS reads its own
(OPENBLAS_THREAD_TIMEOUT) when numpy loads it, so the `ggrun` command sets that one first (cli.app).
A user's own setting of either variable wins.
"""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SYS_CPU = Path("/sys/devices/system/cpu")
_threads = 1


def physical_cores() -> int | None:
    """Physical cores as llama.cpp counts them on Linux: distinct thread-sibling sets (None elsewhere)."""
    siblings = set()
    for path in SYS_CPU.glob("cpu[0-9]*/topology/thread_siblings"):
        try:
            siblings.add(path.read_text().strip())
        except OSError:
            continue
    return len(siblings) or None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), else every CPU."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads() -> int:
    """llama.cpp's default -t: the physical cores (or, where they cannot be counted, its fallback: every
    CPU up to 4, half of them above), at most the CPUs this process may use."""
    cores = physical_cores()
    if cores is None:
        n = os.cpu_count() or 1
        cores = n if n <= 4 else n // 2
    return max(1, min(cores, usable_cpus()))


def set_threads(n: int | None) -> None:
    """Threads for the compiled kernels (numba) and numpy's BLAS (llama.cpp's -t); None: the default."""
    import numba
    from threadpoolctl import threadpool_limits

    global _threads
    n = default_threads() if n is None else n
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    _threads = n
    numba.set_num_threads(n)
    threadpool_limits(limits=n, user_api="blas")


def threads() -> int:
    """The thread count set last (1 until set_threads is called)."""
    return _threads
