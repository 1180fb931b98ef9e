"""Thread count and waiting (core.backends.cpu.threads): llama.cpp's default -t, and idle threads that sleep."""
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


def run_python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**clean, **env}).stdout.strip()


def test_openmp_threads_sleep_unless_the_user_says_otherwise():
    """The policy is in place before numba starts its OpenMP threads (which read it once)."""
    code = ("import os, numba; from ggrun.core.backends.cpu import jit; "
            "print(os.environ['OMP_WAIT_POLICY'], numba.np.ufunc.parallel._is_initialized)")
    assert run_python(code) == "PASSIVE False"
    assert run_python(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE False"


def test_the_command_makes_openblas_threads_sleep_before_numpy_loads():
    code = "import os, sys; import ggrun.cli.app; print(os.environ['OPENBLAS_THREAD_TIMEOUT'], 'numpy' in sys.modules)"
    assert run_python(code) == "4 False"
    assert run_python(code, OPENBLAS_THREAD_TIMEOUT="20") == "20 False"
