"""The backend registry and `ggrun run --list-devices`: SIM only with GGRUN_SIM_DEVICE, devices
first and the CPU last, CUDA listed as unavailable with its reason when cupy is missing; and
`-ngl` through the CLI on the stand-in device giving the CPU's text."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.cli.runner import ggrun_process
from tests.core.gpu import has_gpu

from ggrun.cli.app import _register_commands, app
from ggrun.core.backends import registry
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cupy(monkeypatch):
    """A machine without cupy (None in sys.modules makes `import cupy` raise ImportError), and a
    fresh registry so instances from other tests do not leak in."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(registry, "_instances", {})


def test_without_the_switch_there_is_no_sim_backend(no_cupy, monkeypatch):
    monkeypatch.delenv("GGRUN_SIM_DEVICE", raising=False)
    infos = {i.name: i for i in registry.probe()}
    assert [i.name for i in registry.probe()] == ["CUDA", "SIM", "CPU"]
    assert not infos["SIM"].available and "GGRUN_SIM_DEVICE=1" in infos["SIM"].reason
    backends = registry.usable_backends()
    assert [b.name for b in backends] == ["CPU"] and isinstance(backends[0], CPUBackend)


@pytest.mark.parametrize("value", ["", "0"])
def test_an_empty_or_zero_switch_is_off(no_cupy, monkeypatch, value):
    monkeypatch.setenv("GGRUN_SIM_DEVICE", value)
    assert [b.name for b in registry.usable_backends()] == ["CPU"]


def test_with_the_switch_sim_comes_first_and_the_cpu_last(no_cupy, monkeypatch):
    monkeypatch.setenv("GGRUN_SIM_DEVICE", "1")
    backends = registry.usable_backends()
    assert [b.name for b in backends] == ["SIM", "CPU"]
    assert isinstance(backends[0], SimBackend) and isinstance(backends[1], CPUBackend)
    assert registry.usable_backends()[0] is backends[0]  # created once per process


def test_cuda_is_unavailable_with_a_reason_when_cupy_is_missing(no_cupy):
    cuda = registry.probe()[0]
    assert (cuda.name, cuda.available, cuda.factory) == ("CUDA", False, None)
    assert cuda.reason.startswith("cupy is not installed (") and "Error)" in cuda.reason


def _list_devices() -> list[str]:
    _register_commands()
    result = CliRunner().invoke(app, ["run", "--list-devices"])
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def test_list_devices_without_the_switch(no_cupy, monkeypatch):
    monkeypatch.delenv("GGRUN_SIM_DEVICE", raising=False)
    lines = _list_devices()
    assert [line.split()[0] for line in lines] == ["CUDA", "SIM", "CPU"]
    assert "(unavailable: cupy is not installed (" in lines[0]
    assert lines[1].endswith("(unavailable: set GGRUN_SIM_DEVICE=1 to enable)")
    assert lines[2] == "CPU   host memory, numpy (available)"


def test_list_devices_with_the_switch(no_cupy, monkeypatch):
    monkeypatch.setenv("GGRUN_SIM_DEVICE", "1")
    lines = _list_devices()
    assert [line.split()[0] for line in lines] == ["CUDA", "SIM", "CPU"]
    assert lines[1] == "SIM   stand-in device for tests (numpy kernels, own memory) (available)"
    assert lines[2].endswith("(available)")


def _ggrun(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """A real process whose environment has only the GGRUN_SIM* variables given here."""
    cleared = {k: "" for k in os.environ if k.startswith("GGRUN_SIM")}
    return ggrun_process(*args, env={**cleared, **env})


def test_list_devices_in_a_real_process():
    out = _ggrun(["run", "--list-devices"], GGRUN_SIM_DEVICE="1")
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert names[-2:] == ["SIM", "CPU"] and "(available)" in out.stdout.splitlines()[-2]


@pytest.mark.skipif(has_gpu(), reason="a real GPU comes before SIM and takes -ngl: what a machine without one does")
def test_ngl_on_the_sim_device_gives_the_cpus_text(tiny_llama_path):
    """Greedy text with every layer and the head on SIM equals the CPU-only text; GGRUN_SCHED_DEBUG
    shows the two splits (the embedding lookup on the CPU, the rest on SIM)."""
    args = ["run", "-m", str(tiny_llama_path), "-p", "hello world", "-n", "6", "--temp", "0", "-c", "64"]
    cpu = _ggrun(args)
    sim = _ggrun([*args, "-ngl", "99"], GGRUN_SIM_DEVICE="1", GGRUN_SCHED_DEBUG="1")
    assert cpu.returncode == 0 and sim.returncode == 0, cpu.stderr + sim.stderr
    assert sim.stdout == cpu.stdout and cpu.stdout.strip()
    splits = [line for line in sim.stderr.splitlines() if line.startswith("sched: split")]
    assert splits and {line.split()[3] for line in splits} == {"CPU", "SIM"}
    assert "sched:" not in cpu.stderr


@pytest.mark.skipif(has_gpu(), reason="a real GPU comes before SIM and takes -ngl: what a machine without one does")
def test_ngl_without_a_device_warns_and_runs_on_the_cpu(tiny_llama_path):
    out = _ggrun(["run", "-m", str(tiny_llama_path), "-p", "hello", "-n", "2", "--temp", "0", "-ngl", "2"])
    assert out.returncode == 0, out.stderr
    assert "no device backend is available; -ngl is ignored" in out.stderr
