"""`ggrun bench` on a synthetic tiny llama: every output format parses and holds llama-bench's fields,
comma lists expand to their cartesian product, t/s is tokens over the seconds of the counted
repetitions (through an injected clock), and bad option combinations fail with one line and exit 2
before any model is loaded or timed."""
from __future__ import annotations

import csv
import io
import itertools
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from tests.cli.runner import ggrun_process

from ggrun import cli
from ggrun.cli.app import main
from ggrun.core.errors import BadInput
from ggrun.core.llm import bench as core_bench
from ggrun.core.llm.bench import BenchTest
from ggrun.core.llm.model import Model

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("model_filename", "model_type", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_gpu_layers",
          "n_prompt", "n_gen", "avg_ts", "stddev_ts", "samples_ts", "graph_reuse", "ggrun_version")
SMALL = ["-p", "8", "-n", "4", "-r", "2"]


@pytest.fixture(scope="module")
def app():
    cli.app._register_commands()
    from ggrun.cli import cmd_bench

    return cli.app.app, cmd_bench


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> dict:
    """The tiny model's path and its size and parameter count read independently with gguf's reader."""
    reader = GGUFReader(tiny_llama_path)
    return {"path": str(tiny_llama_path), "size": sum(int(t.n_bytes) for t in reader.tensors),
            "params": sum(int(t.n_elements) for t in reader.tensors)}


def invoke(app, args: list[str]) -> str:
    result = CliRunner().invoke(app[0], ["bench", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def parse(text: str, fmt: str) -> list[dict]:
    if fmt == "json":
        return json.loads(text)
    if fmt == "jsonl":
        return [json.loads(line) for line in text.splitlines()]
    rows = list(csv.DictReader(io.StringIO(text)))
    lists = {"samples_ts", "samples_ns"}
    return [{k: json.loads(v) if k in lists else _number(v) for k, v in r.items()} for r in rows]


def _number(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def check_rates(r: dict) -> None:
    """Each sample's t/s is the test's tokens over its seconds; average and deviation are of those."""
    n = r["n_prompt"] + r["n_gen"]
    assert r["samples_ts"] == pytest.approx([n * 1e9 / ns for ns in r["samples_ns"]], rel=1e-9)
    assert r["avg_ts"] == pytest.approx(statistics.fmean(r["samples_ts"]), rel=1e-9)
    want_sd = statistics.stdev(r["samples_ts"]) if len(r["samples_ts"]) > 1 else 0.0
    assert r["stddev_ts"] == pytest.approx(want_sd, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv"])
def test_machine_formats_hold_llama_bench_fields(app, tiny, fmt):
    from ggrun.cli.cmd_version import ggrun_version

    rows = parse(invoke(app, ["-m", tiny["path"], *SMALL, "-o", fmt]), fmt)
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(8, 0), (0, 4)]
    for r in rows:
        assert set(FIELDS) <= set(r)
        assert r["model_filename"] == tiny["path"]
        assert r["model_size"] == tiny["size"]
        assert r["model_n_params"] == tiny["params"]
        assert r["model_type"] == "llama 0M F32"
        assert (r["n_batch"], r["n_ubatch"], r["n_gpu_layers"], r["graph_reuse"]) == (2048, 512, 0, 1)
        assert r["ggrun_version"] == ggrun_version()
        assert len(r["samples_ts"]) == 2 and all(x > 0 for x in r["samples_ts"])
        check_rates(r)


def test_markdown_table_parses(app, tiny):
    from ggrun.cli.cmd_version import ggrun_version

    text = invoke(app, ["-m", tiny["path"], *SMALL, "-o", "md"])
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["model", "size", "params", "backend", "ngl", "test", "t/s"]
    assert all(set(c.strip()) <= {"-", ":"} for c in table[1].strip("|").split("|"))
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:]]
    assert [r["test"] for r in rows] == ["pp8", "tg4"]
    for r in rows:
        assert r["model"] == "llama 0M F32"
        assert r["size"] == f"{tiny['size'] / 2**20:.2f} MiB"
        assert r["params"] == f"{tiny['params'] / 1e6:.2f} M"
        assert (r["backend"], r["ngl"]) == ("CPU", "0")
        avg, sd = (float(x) for x in r["t/s"].split("±"))
        assert avg > 0 and sd >= 0
    assert lines[-1] == f"build: ggrun {ggrun_version()}"


def test_plan_configs_is_the_cartesian_product():
    models, prompts, gens, pgs = ["a.gguf", "b.gguf"], [8, 0, 16], [4], [BenchTest(4, 2)]
    batches, ubatches, ngls, reuse = [8, 16], [4, 8], [0, 3], [False, True]
    from ggrun.cli.cmd_bench import plan_configs

    configs = plan_configs(models, prompts, gens, pgs, batches, ubatches, ngls, reuse, None)
    tests = [BenchTest(8, 0), BenchTest(16, 0), BenchTest(0, 4), BenchTest(4, 2)]  # -p 0 is no test
    want = list(itertools.product(models, ngls, batches, ubatches, reuse, tests))
    assert len(configs) == 2 * 2 * 2 * 2 * 2 * 4 == len(want)
    assert [(c.model, c.n_gpu_layers, c.n_batch, c.n_ubatch, c.graph_reuse, c.test) for c in configs] == want
    assert all(c.n_ctx == c.test.n_tokens for c in configs)  # default context: what the test needs
    with_ctx = plan_configs(models, prompts, gens, pgs, batches, ubatches, ngls, reuse, 64)
    assert len(with_ctx) == len(configs) and {c.n_ctx for c in with_ctx} == {64}


def test_plan_configs_refuses_bad_combinations():
    from ggrun.cli.cmd_bench import plan_configs

    with pytest.raises(BadInput, match="-ub 16 is larger than -b 8"):
        plan_configs(["m"], [8], [], [], [8, 32], [16], [0], [True], None)
    with pytest.raises(BadInput, match=r"test pp8\+tg8 needs 16 tokens, more than the context \(-c 12\)"):
        plan_configs(["m"], [], [], [BenchTest(8, 8)], [8], [8], [0], [True], 12)
    with pytest.raises(BadInput, match="no test to run"):
        plan_configs(["m"], [0], [0], [], [8], [8], [0], [True], None)


def test_output_rows_are_the_product_and_rates_follow_the_injected_clock(app, tiny, monkeypatch):
    """24 configurations run; with a clock that advances 1/8 s per read, every counted repetition
    lasts 1/8 s, so t/s is exactly 8 x tokens; the warm-up of each configuration reads no clock."""
    ticks = itertools.count()
    runs = []
    real_run_once = core_bench.run_once
    monkeypatch.setattr(core_bench, "run_once", lambda *a: (runs.append(1), real_run_once(*a)))
    clock_reads = []

    def clock() -> float:
        clock_reads.append(1)
        return next(ticks) / 8

    monkeypatch.setattr(app[1], "run_bench", partial(core_bench.run_bench, clock=clock))
    args = ["-m", tiny["path"], "-p", "8,4", "-n", "4", "-b", "8,16", "-ub", "4,8", "--graph-reuse", "0,1",
            "-r", "2", "-o", "jsonl"]
    rows = parse(invoke(app, args), "jsonl")

    tests = [(8, 0), (4, 0), (0, 4)]
    want = list(itertools.product([8, 16], [4, 8], [0, 1], tests))
    assert [(r["n_batch"], r["n_ubatch"], r["graph_reuse"], (r["n_prompt"], r["n_gen"])) for r in rows] == want
    assert len(runs) == len(want) * 3  # one warm-up and two counted repetitions each
    assert len(clock_reads) == len(want) * 2 * 2  # two reads per counted repetition only
    for r in rows:
        n = r["n_prompt"] + r["n_gen"]
        assert r["samples_ns"] == [125_000_000, 125_000_000]
        assert r["samples_ts"] == pytest.approx([8.0 * n, 8.0 * n])
        assert (r["avg_ts"], r["stddev_ts"]) == (pytest.approx(8.0 * n), 0.0)

    from ggrun.cli.cmd_bench import markdown

    header = markdown(rows).splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")] == \
        ["model", "size", "params", "backend", "ngl", "n_batch", "n_ubatch", "graph_reuse", "test", "t/s"]


# ---- bad input: one line, exit 2, nothing loaded or timed ------------------------------------------


@pytest.fixture
def nothing_runs(monkeypatch, app):
    """Loading a model or running a test is a failure: bad input must be refused before either."""
    def forbidden(*a, **k):
        raise AssertionError("a model was loaded or a test was run before the options were checked")

    monkeypatch.setattr(app[1], "load_model", forbidden)
    monkeypatch.setattr(Model, "load", forbidden)
    monkeypatch.setattr(core_bench, "run_once", forbidden)
    monkeypatch.setattr(app[1], "run_bench", forbidden)


def run_main(monkeypatch, capsys, args: list[str]) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["ggrun", "bench", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture(scope="module")
def unreadable(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("unreadable")
    (d / "garbage.gguf").write_bytes(b"this is not a GGUF file at all")
    (d / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (d / "folder.gguf").mkdir()
    return {k: str(d / f"{k}.gguf") for k in ("garbage", "truncated", "folder", "missing")}


BAD = [
    (["-ub", "16", "-b", "8"], "-ub 16 is larger than -b 8"),
    (["-ub", "8", "-b", "16,4"], "-ub 8 is larger than -b 4"),
    (["-c", "8", "-n", "16"], "test tg16 needs 16 tokens, more than the context (-c 8)"),
    (["-c", "10", "-pg", "8,4"], "test pp8+tg4 needs 12 tokens, more than the context (-c 10)"),
    (["-r", "0"], "-r 0 must be positive"),
    (["-o", "xml"], "-o xml: choose one of md, csv, json, jsonl"),
    (["-p", "8,x"], "-p 8,x: expected a comma-separated list of integers"),
    (["--graph-reuse", "2"], "--graph-reuse 2: values must be 0 or 1"),
    (["-pg", "8"], "-pg 8: expected PP,TG (two integers)"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_options_fail_before_loading(app, tiny, nothing_runs, monkeypatch, capsys, args, message):
    code, out, err = run_main(monkeypatch, capsys, ["-m", tiny["path"], *SMALL, *args])
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"error: {message}"], err


@pytest.mark.parametrize("kind", ["missing", "garbage", "truncated", "folder"])
def test_unreadable_model_fails_before_any_model_is_loaded(app, tiny, unreadable, nothing_runs, monkeypatch,
                                                           capsys, kind):
    """Even after a good model in the list: nothing is benchmarked when one model cannot be read."""
    bad = unreadable[kind]
    code, out, err = run_main(monkeypatch, capsys, ["-m", f"{tiny['path']},{bad}", *SMALL])
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and bad in err, err


def test_exit_code_and_message_of_the_real_process(tiny):
    args = ["-m", tiny["path"], *SMALL, "-ub", "16", "-b", "8"]
    proc = ggrun_process("bench", *args, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", "error: -ub 16 is larger than -b 8\n")
