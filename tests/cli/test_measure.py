"""`ggrun measure`: its JSON keys and figures, comma lists expanding to their product, metadata only
(a multi-GB sparse model measured in a small process), `--verify` passing on SmolLM2 and failing
with one line and exit 1 on a wrong plan, and bad options refused with exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from tests.cli.runner import ENTRY

from ggrun import cli
from ggrun.cli.app import main
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cpu.matmul import repacked_bytes
from ggrun.core.dtypes import DType
from ggrun.core.llm.memory import measure
from ggrun.core.llm.model import Model
from ggrun.core.sched import Scheduler

ROOT = Path(__file__).resolve().parents[2]
KEYS = ["ctx", "ubatch", "logits", "backend", "weights_file_bytes", "weights_resident_bytes", "kv_bytes",
        "output_bytes", "compute_planned_bytes", "compute_no_reuse_bytes", "compute_lower_bound_bytes", "nodes",
        "splits", "plan_ms", "flash_attn", "kv_swa_bytes"]


@pytest.fixture(scope="module")
def app():
    cli.app._register_commands()
    return cli.app.app


def run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["ggrun", "measure", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_json_keys_and_the_product_of_comma_lists(app, tiny_llama_path):
    result = CliRunner().invoke(app, ["measure", "-m", str(tiny_llama_path), "-c", "64,128", "-ub", "8,16",
                                      "-b", "32", "-o", "json"])
    assert result.exit_code == 0, (result.output, result.exception)
    records = json.loads(result.stdout)
    assert all(list(r) == KEYS for r in records)
    assert [(r["ctx"], r["ubatch"], r["logits"]) for r in records] == \
        [(c, ub, mode) for c in (64, 128) for ub in (8, 16) for mode in ("all", "last")]
    assert {r["backend"] for r in records} == {"CPU"} and {r["flash_attn"] for r in records} == {True}  # the default

    # the same figures as the runtime's own measure on the same metadata-only model (all but timing)
    model = Model.load(tiny_llama_path, [CPUBackend()], metadata_only=True)
    want = [r.to_json() for c in (64, 128) for ub in (8, 16) for r in measure(model, c, ub, 32, 1, flash_attn=True)]
    strip = [{k: v for k, v in r.items() if k != "plan_ms"} for r in want]
    assert [{k: v for k, v in r.items() if k != "plan_ms"} for r in records] == strip
    total = sum(int(t.n_bytes) for t in GGUFReader(tiny_llama_path).tensors)
    assert all(r["weights_file_bytes"] == total for r in records)
    assert all(r["compute_lower_bound_bytes"] <= r["compute_planned_bytes"] <= r["compute_no_reuse_bytes"]
               for r in records)


def test_table_has_a_row_per_configuration(app, tiny_llama_path):
    result = CliRunner().invoke(app, ["measure", "-m", str(tiny_llama_path), "-c", "64,128", "-ub", "8"])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in result.stdout.splitlines() if "│" in line]
    body = [r for r in rows if r and r[0].isdigit()]
    assert [(r[0], r[1], r[2], r[3]) for r in body] == \
        [("64", "8", "all", "CPU"), ("64", "8", "last", "CPU"), ("128", "8", "all", "CPU"), ("128", "8", "last", "CPU")]
    assert tiny_llama_path.name in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 100
    header = [c.strip() for c in next(line for line in result.stdout.splitlines() if "ctx" in line).split("┃")[1:-1]]
    assert header == ["ctx", "ub", "logits", "backend", "weights", "KV", "output", "compute", "total"]
    for r in body:  # the total is the sum of the parts (each rounded to 0.01 MiB)
        assert float(r[8]) == pytest.approx(sum(float(x) for x in r[4:8]), abs=0.03)


def test_verbose_table_adds_the_planner_columns(app, tiny_llama_path):
    result = CliRunner().invoke(app, ["measure", "-m", str(tiny_llama_path), "-c", "64-128*2", "-ub", "8", "-v"])
    assert result.exit_code == 0, (result.output, result.exception)
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in result.stdout.splitlines() if "│" in line]
    header = [c.strip() for c in next(line for line in result.stdout.splitlines() if "ctx" in line).split("┃")[1:-1]]
    assert header[9:] == ["weights file", "KV window", "no reuse", "lower bound", "planned/lb", "nodes", "splits",
                          "plan ms"]
    assert [r[0] for r in rows if r and r[0].isdigit()] == ["64", "64", "128", "128"]  # -c 64-128*2


@pytest.fixture
def nothing_loads(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(Model, "load", forbidden)


BAD = [
    (["-c", "0"], "-c 0: values must be at least 1"),
    (["-c", "512,x"], "-c 512,x: expected integers or ranges (first-last, first-last+step, first-last*mult)"),
    (["-ub", "0,8"], "-ub 0,8: values must be at least 1"),
    (["-o", "xml"], "-o xml: choose table or json"),
    (["-np", "0"], "-np 0 must be positive"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_options_exit_2_with_one_line(tiny_llama_path, nothing_loads, monkeypatch, capsys, args, message):
    code, out, err = run_main(monkeypatch, capsys, ["-m", str(tiny_llama_path), *args])
    assert (code, out, err.splitlines()) == (2, "", [f"error: {message}"])


def test_missing_model_exits_2(tmp_path, nothing_loads, monkeypatch, capsys):
    missing = str(tmp_path / "nope.gguf")
    code, out, err = run_main(monkeypatch, capsys, ["-m", missing])
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {missing}: no such file")


# ---- metadata only: a multi-GB model in a small process ---------------------------------------------


def test_sparse_big_model_is_measured_from_metadata(tmp_path):
    """A ~3.8 GB Q4_K llama of Llama-3-8B's shape (sparse: a few KB on disk); measuring it keeps the
    process's peak resident memory small, though its weights would take ~3.8 GB."""
    from ggrun.loaders.synthetic import write_sparse_big

    path = write_sparse_big(tmp_path / "big.gguf")
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert file_bytes > 3 * 2**30
    repacked = sum(repacked_bytes(DType.of_ggml(t.tensor_type.name), tuple(reversed(t.shape)))  # for decode
                   for t in GGUFReader(path).tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
    out, err, peak = tmp_path / "out.json", tmp_path / "err.txt", tmp_path / "peak.txt"
    cmd = [*ENTRY, "measure", "-m", str(path), "-c", "2048", "-ub", "512", "-o", "json"]
    # A child's peak RSS counts the memory of the process it was forked from (Linux keeps the
    # high-water mark across exec), and this test process may hold a loaded model: so a small
    # fresh interpreter starts ggrun and reports its child's peak.
    trampoline = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
                  "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
                  "sys.exit(code)")
    t0 = time.perf_counter()
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.run([sys.executable, "-c", trampoline, str(peak), *cmd], cwd=ROOT, stdout=fo, stderr=fe,
                              env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, err.read_text()
    peak_mb = int(peak.read_text()) / 1024  # kilobytes on Linux
    assert peak_mb < 400, f"peak resident memory {peak_mb:.0f} MB"
    assert seconds < 60
    records = json.loads(out.read_text())
    assert [r["logits"] for r in records] == ["all", "last"]
    for r in records:
        assert r["weights_file_bytes"] == file_bytes
        assert r["weights_resident_bytes"] == file_bytes + repacked  # what a real load would take, never taken
        assert r["kv_bytes"] == 2 * 32 * 2048 * 8 * 128 * 2
        assert 0 < r["compute_lower_bound_bytes"] <= r["compute_planned_bytes"] <= 1.05 * r["compute_lower_bound_bytes"]


# ---- --verify ---------------------------------------------------------------------------------------


def test_verify_passes_on_smollm2(smollm2_path, monkeypatch, capsys):
    code, out, err = run_main(monkeypatch, capsys, ["-m", str(smollm2_path), "-c", "256", "-ub", "64", "-o", "json",
                                                    "--verify"])
    assert code == 0, err
    assert [(r["ctx"], r["ubatch"]) for r in json.loads(out)] == [(256, 64), (256, 64)]
    lines = [line for line in err.splitlines() if line.startswith("verify")]
    assert len(lines) == 1 and lines[0].startswith("verify ctx 256 ub 64: plan held ("), err


def test_verify_fails_loudly_on_a_wrong_plan(tiny_llama_path, monkeypatch, capsys):
    """The first graph --verify allocates gets its positions input placed on the bytes of its token
    ids: one line naming the overlap, exit 1."""
    real = Scheduler.alloc
    calls = []

    def alloc(self, sg):
        plans = real(self, sg)
        if not calls:
            plan = plans["CPU"]
            by_name = {t.name: t for t in plan.offsets}
            tokens, pos = by_name["inp_tokens"], by_name["inp_pos"]
            pos.place(self.allocators["CPU"].buffer, plan.offsets[tokens])
            plan.offsets[pos] = plan.offsets[tokens]
        calls.append(1)
        return plans

    monkeypatch.setattr(Scheduler, "alloc", alloc)
    code, out, err = run_main(monkeypatch, capsys, ["-m", str(tiny_llama_path), "-c", "64", "-ub", "16", "--verify"])
    assert code == 1
    assert len(err.splitlines()) == 1 and err.startswith("error: plan overlap: ") and "inp_tokens" in err, err
    assert calls  # the failure came from the plan check, not from anything before it
