"""How many threads the compiled kernels and numpy's BLAS use (llama.cpp's -t), and how idle ones wait
(llama.cpp's --poll).

The default is llama.cpp's: one thread per physical core (common_cpu_get_num_math: hyper-threads do not
help linear algebra), counted from Linux's CPU topology, and here never more than the CPUs this process
may run on.

An idle thread polls for new work a while before it sleeps, as llama.cpp's do: --poll 0..100 (default
50) is llama.cpp's level, 1024 * 128 rounds of a pause each per level (llama.cpp's
ggml_graph_compute_poll_for_work; about 3 ms a level here, a round ~25 ns). ggrun's threads are numba's OpenMP team, so
the level becomes libgomp's GOMP_SPINCOUNT (rounds of the same kind), and level 0 OMP_WAIT_POLICY=PASSIVE
(sleep at once). Polling threads wake in microseconds, so the layers' products of a decode step split
across the threads (matmul.py); sleeping ones take ~60 us, which only the large products repay. A
polling thread holds its core, though: beside other busy processes every split product then waits for a
partner the scheduler has put behind them (26-90 times slower at -t 2), which crowding.py watches for,
running decode steps on one thread while it lasts.

OpenMP reads its wait settings once, when numba starts its threads: set_threads (the first call that
starts them) puts the level's settings in place first, and this module puts the default's in place on
import for a program that starts them otherwise. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins
over the default, an explicit --poll over both. OpenBLAS reads its own (OPENBLAS_THREAD_TIMEOUT) when
numpy loads it, so the `ggrun` command sets that one first (cli.app).
"""
from __future__ import annotations

import os
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
DEFAULT_POLL = 50  # llama.cpp's default level
MAX_POLL = 100
POLL_ROUNDS = 1024 * 128  # pause rounds per level (llama.cpp's n_rounds)
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what OpenMP reads (this module sets them on import)
_threads = 1
_poll = DEFAULT_POLL


def wait_environment(level: int) -> dict[str, str | None]:
    """libgomp's settings for poll level `level` (None: the variable unset)."""
    if level == 0:
        return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    return {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": str(POLL_ROUNDS * level)}


def _apply_wait(level: int, explicit: bool) -> None:
    """Put level's settings into the environment OpenMP reads; a user's own, unless explicit, stay."""
    if not explicit and any(name in os.environ for name in WAIT_VARIABLES):
        return
    for name, value in wait_environment(level).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _environment_poll() -> int:
    """The level the environment's wait settings amount to (the user's own, or the default's)."""
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" or os.environ.get("GOMP_SPINCOUNT") == "0":
        return 0
    return DEFAULT_POLL


_apply_wait(DEFAULT_POLL, explicit=False)
_poll = _environment_poll()


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


def started() -> bool:
    """Whether numba has started its threads (after which OpenMP's wait settings are fixed)."""
    from numba.np.ufunc import parallel

    return bool(parallel._is_initialized)


def set_threads(n: int | None, poll: int | None = None) -> None:
    """Threads for the compiled kernels (numba) and numpy's BLAS (llama.cpp's -t; None: the default) and
    how long idle ones poll (llama.cpp's --poll level, 0..100; None: the default or the user's
    environment). The level reaches OpenMP only where its threads have not started yet (a process's
    first call); the splitting of products follows it either way."""
    import numba
    from threadpoolctl import threadpool_limits

    global _threads, _poll
    if poll is not None:
        if not 0 <= poll <= MAX_POLL:
            raise ValueError(f"poll level {poll} is not in 0..{MAX_POLL}")
        if not started():
            _apply_wait(poll, explicit=True)
        _poll = poll
    n = default_threads() if n is None else n
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    _threads = n
    numba.set_num_threads(n)
    threadpool_limits(limits=n, user_api="blas")


def threads() -> int:
    """The thread count set last (1 until set_threads is called)."""
    return _threads


def poll() -> int:
    """The poll level in force (llama.cpp's --poll): 0, idle threads sleep at once."""
    return _poll
