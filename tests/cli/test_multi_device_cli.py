"""Several devices through the commands, with two stand-in devices (GGRUN_SIM_DEVICE=2: SIM0, SIM1): the
registry and --list-devices, `run` with -sm layer and -sm row giving the CPU's text and GGRUN_SCHED_DEBUG
counting device-to-device copies, `bench` rows with llama-bench's split fields, `measure` per device
(for devices of this machine, and for stand-ins it need not have: --plan-devices) with --verify holding
every figure against a real run, and bad -dev/-sm/-ts/-mg values as one line and exit 2."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gguf import GGUFReader

from ggrun.cli import cmd_measure
from ggrun.core.backends import registry
from tests.cli.runner import ggrun, ggrun_process

PROSE = Path(__file__).resolve().parents[1] / "data" / "ppl_prose.txt"
TEXT = ["-p", "hello world", "-n", "6", "--temp", "0", "-c", "64", "-no-cnv"]


@pytest.fixture
def two_sims(monkeypatch):
    """Two stand-in devices, no GPU (None in sys.modules makes `import cupy` fail), a fresh registry."""
    monkeypatch.setenv("GGRUN_SIM_DEVICE", "2")
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)
    monkeypatch.setattr(registry, "_instances", {})


@pytest.fixture(scope="module")
def tiny4(tiny_llama_factory):
    return tiny_llama_factory(n_layer=4)


def _process(args: list, **env: str):
    cleared = {k: "" for k in os.environ if k.startswith("GGRUN_SIM") or k.startswith("GGRUN_SCHED")}
    return ggrun_process(*args, env={**cleared, **env})


# ---- registry ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, names", [("1", ["SIM"]), ("yes", ["SIM"]), ("2", ["SIM0", "SIM1"]),
                                          ("3", ["SIM0", "SIM1", "SIM2"])])
def test_the_switch_gives_that_many_stand_in_devices(two_sims, monkeypatch, value, names):
    monkeypatch.setenv("GGRUN_SIM_DEVICE", value)
    assert [b.name for b in registry.usable_backends()] == [*names, "CPU"]


def test_list_devices_shows_each_device(two_sims, capsys, monkeypatch):
    code, out, _ = ggrun(capsys, monkeypatch, "run", "--list-devices")
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["CUDA", "SIM0", "SIM1", "CPU"]
    assert lines[1].endswith("(available)") and lines[2].endswith("(available)")


# ---- run -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split, copies", [
    (["-sm", "layer", "-ts", "1,1"], "device->device 2 (512 bytes)"),  # a decode step: layer 2's two outputs
    # 10 per layer (x to the other device and back for q/k/v as one product per device, attention's output,
    # the gated product and the down projection: 1 + 3 + 2 + 2 + 2), 2 for the head
    (["-sm", "row", "-ts", "3,1", "-mg", "1"], "device->device 42 "),
])
def test_run_over_two_devices_gives_the_cpus_text(tiny4, split, copies):
    cpu = _process(["run", "-m", tiny4, *TEXT])
    two = _process(["run", "-m", tiny4, *TEXT, "-ngl", "99", *split], GGRUN_SIM_DEVICE="2", GGRUN_SCHED_DEBUG="1")
    assert cpu.returncode == 0 and two.returncode == 0, cpu.stderr + two.stderr
    assert two.stdout == cpu.stdout and cpu.stdout.strip()
    counts = [line for line in two.stderr.splitlines() if line.startswith("sched: copies per compute:")]
    assert counts and copies in counts[-1], two.stderr
    backends = {line.split()[3] for line in two.stderr.splitlines() if line.startswith("sched: split")}
    assert backends == {"CPU", "SIM0", "SIM1"}


@pytest.mark.parametrize("command", ["run", "bench", "perplexity", "parallel", "measure"])
@pytest.mark.parametrize("args, fragment", [
    (["-ts", "1,1,1"], "-ts 1,1,1: 3 proportions for 2 device(s) (SIM0, SIM1)"),
    (["-mg", "2", "-sm", "none"], "-mg 2: the devices used are numbered 0..1"),
    (["-dev", "CUDA7"], "-dev CUDA7: no device named CUDA7 (available: SIM0, SIM1; see --list-devices)"),
    (["-sm", "tensor"], "-sm tensor: choose one of none, layer, row"),
    (["-ts", "a,b"], "-ts a,b: give proportions per device"),
    (["-dev", "none,SIM0"], "-dev none,SIM0: give device names"),
])
def test_bad_device_options_are_one_line_and_exit_2(two_sims, tiny4, capsys, monkeypatch, command, args, fragment):
    extra = {"perplexity": ["-f", PROSE], "bench": ["-p", "4", "-n", "0", "-r", "1"]}.get(command, [])
    if command == "bench" and args[0] in ("-ts", "-dev"):  # llama-bench: ',' between values, '/' inside one
        args = [args[0], args[1].replace(",", "/")]
        fragment = fragment.replace("a,b", "a/b").replace("none,SIM0", "none/SIM0")
    code, out, err = ggrun(capsys, monkeypatch, command, "-m", tiny4, "-ngl", "99", *extra, *args)
    assert code == 2 and out == "", err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and fragment in err, err


# ---- bench -----------------------------------------------------------------------------------------


def test_bench_rows_carry_llama_benchs_split_fields(two_sims, tiny4, capsys, monkeypatch):
    code, out, err = ggrun(capsys, monkeypatch, "bench", "-m", tiny4, "-ngl", "99", "-sm", "layer,row", "-ts", "3/1",
                           "-dev", "SIM0/SIM1", "-p", "8", "-n", "2", "-r", "1", "-o", "json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["split_mode"], r["n_prompt"]) for r in rows] == [("layer", 8), ("layer", 0), ("row", 8), ("row", 0)]
    assert {(r["tensor_split"], r["devices"], r["main_gpu"], r["backends"]) for r in rows} == \
        {("3.00/1.00", "SIM0/SIM1", 0, "SIM")}
    code, out, err = ggrun(capsys, monkeypatch, "bench", "-m", tiny4, "-ngl", "99", "-sm", "row", "-ts", "1/1",
                           "-p", "8", "-n", "0", "-r", "1")
    assert code == 0, err
    assert out.splitlines()[0].split("|")[5:8] == [" ngl ", " threads ", " sm         "]


# ---- measure ---------------------------------------------------------------------------------------


def _measure(capsys, monkeypatch, path, *args) -> tuple[int, list[dict], str]:
    code, out, err = ggrun(capsys, monkeypatch, "measure", "-m", path, "-c", "64", "-ub", "16", "-o", "json", *args)
    return code, json.loads(out) if code == 0 else [], err


def _tensor_bytes(path, select) -> int:
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if select(t.name))


def test_measure_per_device_for_stand_ins_this_machine_lacks(tiny4, capsys, monkeypatch):
    """-ts 3,1 over 4 layers and the head: every layer on SIM0, the head on SIM1 (test_placement's rule), so
    SIM1 holds the output weights and no KV cache; --verify loads the model onto the stand-ins for real and
    finds every figure as measured."""
    monkeypatch.delenv("GGRUN_SIM_DEVICE", raising=False)
    code, records, err = _measure(capsys, monkeypatch, tiny4, "--plan-devices", "2", "-ngl", "99", "-ts", "3,1",
                                  "--verify")
    assert code == 0, err
    by = {r["backend"]: r for r in records if r["logits"] == "all"}
    assert list(by) == ["SIM0", "SIM1", "CPU"]
    assert by["SIM1"]["kv_bytes"] == 0 and by["SIM0"]["kv_bytes"] == 2 * 4 * 64 * 32 * 2  # K and V, 4 layers, f16
    assert by["SIM1"]["weights_file_bytes"] == _tensor_bytes(tiny4, lambda n: n.startswith("output"))
    assert by["SIM0"]["weights_file_bytes"] == _tensor_bytes(tiny4, lambda n: n.startswith("blk."))
    assert all(by[d]["compute_planned_bytes"] > 0 for d in ("SIM0", "SIM1"))
    verified = [line for line in err.splitlines() if line.startswith("verify")]
    assert len(verified) == 1 and "each backend took what was measured: SIM0 weights" in verified[0], err


def test_measure_row_split_on_this_machines_devices(two_sims, tiny4, capsys, monkeypatch):
    code, records, err = _measure(capsys, monkeypatch, tiny4, "-ngl", "99", "-sm", "row", "-ts", "1,1", "-mg", "1",
                                  "--verify")
    assert code == 0, err
    by = {r["backend"]: r for r in records if r["logits"] == "all"}
    assert by["SIM0"]["kv_bytes"] == 0 and by["SIM1"]["kv_bytes"] > 0  # the cache stays on the main device
    layers = _tensor_bytes(tiny4, lambda n: n.startswith("blk.") and "norm" not in n)
    head = next(t for t in GGUFReader(tiny4).tensors if t.name == "output.weight")
    n_vocab = int(head.shape[1])  # GGUF lists dimensions innermost first
    # half of every layer matrix's rows (multiples of 16 here); of the head's, half rounded down to 16
    assert by["SIM0"]["weights_file_bytes"] == layers // 2 + int(head.n_bytes) // n_vocab * (n_vocab // 2 // 16 * 16)
    assert "each backend took what was measured" in err


def test_verify_names_a_device_whose_figure_the_run_does_not_match(tiny4, capsys, monkeypatch):
    real = cmd_measure.measure

    def off_by_one(*args, **kw):
        records = real(*args, **kw)
        for r in records:
            if r.backend == "SIM1":
                r.kv_bytes += 1
        return records

    monkeypatch.setattr(cmd_measure, "measure", off_by_one)
    code, _, err = _measure(capsys, monkeypatch, tiny4, "--plan-devices", "2", "-ngl", "99", "-ts", "1,1", "--verify")
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "SIM1 KV: measured" in err and "the run took" in err, err


def test_plan_devices_must_not_be_negative(tiny4, capsys, monkeypatch):
    code, _, err = _measure(capsys, monkeypatch, tiny4, "--plan-devices", "-1")
    assert code == 2 and "--plan-devices -1" in err
