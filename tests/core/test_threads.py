"""Thread count and waiting (core.backends.cpu.threads): llama.cpp's default -t, and idle threads that poll
at llama.cpp's level (--poll) before they sleep, through the settings OpenMP reads when its threads start."""
from __future__ import annotations

import os
import subprocess
import sys

import numba
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from ggrun.core.backends.cpu import threads


def fake_topology(root, siblings: list[str]) -> None:
    for cpu, mask in enumerate(siblings):
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings").write_text(mask + "\n")
    (root / "cpufreq").mkdir()  # not a CPU


def test_physical_cores_count_sibling_sets(tmp_path, monkeypatch):
    fake_topology(tmp_path, ["00000011", "00000011", "00000044", "00000044", "00000100"])
    monkeypatch.setattr(threads, "SYS_CPU", tmp_path)
    assert threads.physical_cores() == 3  # two cores with a hyper-thread each, one without


def test_default_is_the_physical_cores_within_the_affinity(tmp_path, monkeypatch):
    fake_topology(tmp_path, ["3", "3", "c", "c", "30", "30"])
    monkeypatch.setattr(threads, "SYS_CPU", tmp_path)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 6)
    assert threads.default_threads() == 3
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    assert threads.default_threads() == 2


@pytest.mark.parametrize("cpus, want", [(1, 1), (4, 4), (16, 8)])
def test_without_a_topology_the_default_is_llama_cpps_fallback(tmp_path, monkeypatch, cpus, want):
    monkeypatch.setattr(threads, "SYS_CPU", tmp_path / "missing")
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(threads, "usable_cpus", lambda: cpus)
    assert threads.default_threads() == want


def test_set_threads_none_is_the_default_for_numba_and_blas():
    before = threads.threads(), numba.get_num_threads()
    with threadpool_limits(limits=None):  # gives BLAS its own count back afterwards
        try:
            threads.set_threads(None)
            n = min(threads.default_threads(), numba.config.NUMBA_NUM_THREADS)
            assert threads.threads() == n and numba.get_num_threads() == n
            assert all(lib["num_threads"] == n for lib in threadpool_info() if lib["user_api"] == "blas")
        finally:
            threads.set_threads(before[0])
            numba.set_num_threads(before[1])


WAIT = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")


def run_python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in WAIT}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**clean, **env}).stdout.strip()


SHOW = ("import os, numba; from ggrun.core.backends.cpu import jit; {}"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), jit.poll(), "
        "numba.np.ufunc.parallel._is_initialized)")


def test_openmp_threads_poll_at_llama_cpps_default_level():
    """The settings are in place before numba starts its OpenMP threads (which read them once)."""
    assert run_python(SHOW.format("")) == f"None {threads.POLL_ROUNDS * 50} 50 False"


def test_a_users_own_wait_settings_win_over_the_default():
    assert run_python(SHOW.format(""), OMP_WAIT_POLICY="PASSIVE") == "PASSIVE None 0 False"
    assert run_python(SHOW.format(""), GOMP_SPINCOUNT="1000") == "None 1000 50 False"


def test_an_explicit_level_wins_and_is_set_before_the_threads_start():
    """Level 0 sleeps at once (and replaces the user's spin count); set_threads then starts the threads."""
    assert run_python(SHOW.format("jit.set_threads(2, 0); "), GOMP_SPINCOUNT="1000") == "PASSIVE None 0 True"
    code = SHOW.format("jit.set_threads(2, 3); ")
    assert run_python(code, OMP_WAIT_POLICY="PASSIVE") == f"None {3 * threads.POLL_ROUNDS} 3 True"


def test_a_level_given_after_the_threads_started_changes_the_splitting_only():
    code = SHOW.format("jit.set_threads(2); jit.set_threads(2, 0); ")
    assert run_python(code) == f"None {50 * threads.POLL_ROUNDS} 0 True"


@pytest.mark.parametrize("level", [-1, 101])
def test_levels_out_of_range_are_refused(level):
    with pytest.raises(ValueError):
        threads.set_threads(threads.threads(), level)


def test_the_command_makes_openblas_threads_sleep_before_numpy_loads():
    code = "import os, sys; import ggrun.cli.app; print(os.environ['OPENBLAS_THREAD_TIMEOUT'], 'numpy' in sys.modules)"
    assert run_python(code) == "4 False"
    assert run_python(code, OPENBLAS_THREAD_TIMEOUT="20") == "20 False"
