"""`ggrun bench` on a synthetic tiny llama: every output format parses and holds llama-bench's fields,
comma lists expand to their cartesian product, t/s is tokens over the seconds of the counted
repetitions (through an injected clock), and bad option combinations fail with one line and exit 2
before any model is loaded or timed."""
from __future__ import annotations

import csv
import io
import itertools
import json
import re
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
from ggrun.cli.cmdline import parse_settings
from ggrun.core.backends.cpu import jit, threads
from ggrun.core.errors import BadInput
from ggrun.core.llm import bench as core_bench
from ggrun.core.llm.bench import BenchTest
from ggrun.core.llm.model import Model

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("build_commit", "cpu_info", "gpu_info", "backends", "model_filename", "model_type", "model_size",
          "model_n_params", "n_batch", "n_ubatch", "n_threads", "poll", "type_k", "type_v", "n_gpu_layers", "split_mode",
          "main_gpu", "flash_attn", "devices", "tensor_split", "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "ggrun_version",
          "n_ctx", "graph_reuse", "numerics")
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
    return [{k: _number(v) for k, v in r.items()} for r in rows]


def _number(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def check_rates(r: dict) -> None:
    """Each sample's t/s is the test's tokens over its seconds; average and deviation are of those (csv
    has no samples, as llama-bench's: its average is checked against the average time)."""
    n = r["n_prompt"] + r["n_gen"]
    if "samples_ts" not in r:
        assert r["avg_ts"] >= n * 1e9 / r["avg_ns"] * (1 - 1e-6)  # the mean of rates >= the rate of the mean time
        return
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
        assert list(r)[:len(FIELDS)] == list(FIELDS)  # llama-bench's fields in its order, then ggrun's
        assert r["model_filename"] == tiny["path"]
        assert r["model_size"] == tiny["size"]
        assert r["model_n_params"] == tiny["params"]
        assert r["model_type"] == "llama ?B (guessed) all F32"  # llama.cpp's words for a file without file_type
        assert (r["n_batch"], r["n_ubatch"], r["n_gpu_layers"], r["graph_reuse"]) == (2048, 512, 0, 1)
        assert (r["type_k"], r["type_v"], r["flash_attn"], r["n_depth"], r["backends"]) == ("f16", "f16", -1, 0, "CPU")
        assert r["poll"] == jit.poll()
        assert r["n_threads"] >= 1 and r["cpu_info"] and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r["test_time"])
        assert r["ggrun_version"] == ggrun_version()
        if fmt != "csv":
            assert len(r["samples_ts"]) == 2 and all(x > 0 for x in r["samples_ts"])
        check_rates(r)


def test_markdown_table_parses(app, tiny):
    from ggrun.cli.cmd_version import ggrun_version

    text = invoke(app, ["-m", tiny["path"], *SMALL, "-o", "md"])
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["model", "size", "params", "backend", "threads", "test", "t/s"]
    assert all(set(c.strip()) <= {"-", ":"} for c in table[1].strip("|").split("|"))
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:]]
    assert [r["test"] for r in rows] == ["pp8", "tg4"]
    for r in rows:
        assert r["model"] == "llama ?B (guessed) all F32"
        assert r["size"] == f"{tiny['size'] / 2**20:.2f} MiB"
        assert r["params"] == f"{tiny['params'] / 1e6:.2f} M"
        assert r["backend"] == "CPU" and int(r["threads"]) >= 1
        avg, sd = (float(x) for x in r["t/s"].split("±"))
        assert avg > 0 and sd >= 0
    # llama-bench's widths: model 30 left, size and params 10, backend 10 left, threads 7, test 15, t/s 20
    assert table[0] == ("| model                          |       size |     params | backend    | threads |"
                        "            test |                  t/s |")
    assert table[1] == ("| ------------------------------ | ---------: | ---------: | ---------- | ------: |"
                        " --------------: | -------------------: |")
    assert re.fullmatch(r"build: \S+ \(ggrun " + re.escape(ggrun_version()) + r"\)", lines[-1])
    assert lines[-2] == ""


def test_configs_are_the_cartesian_product_in_llama_bench_order():
    from ggrun.cli.cmd_bench import BenchSettings

    s = BenchSettings(models=("a.gguf", "b.gguf"), n_prompt=(8, 0, 16), n_gen=(4,), pg=((4, 2),), n_batch=(8, 16),
                      n_ubatch=(4, 8), n_gpu_layers=(0, 3), graph_reuse=(False, True), n_threads=(1, 2),
                      n_depth=(0, 5), flash_attn=(0, 1))
    configs = s.configs()
    tests = [BenchTest(8, 0), BenchTest(16, 0), BenchTest(0, 4), BenchTest(4, 2)]  # -p 0 is no test
    want = [(m, ngl, b, ub, fa, r, t, BenchTest(x.n_prompt, x.n_gen, d))
            for m, ngl, b, ub, fa, r, t, d, x in itertools.product(
                ["a.gguf", "b.gguf"], [0, 3], [8, 16], [4, 8], [0, 1], [False, True], [1, 2], [0, 5], tests)]
    assert [(c.model, c.n_gpu_layers, c.n_batch, c.n_ubatch, c.flash_attn, c.graph_reuse, c.n_threads, c.test)
            for c in configs] == want
    assert all(c.n_ctx == c.test.n_tokens + c.test.n_depth for c in configs)  # default context: what it needs
    with_ctx = BenchSettings(n_prompt=(8,), n_gen=(4,), n_ctx=64).configs()
    assert {c.n_ctx for c in with_ctx} == {64}


def test_configs_refuse_what_cannot_run():
    from ggrun.cli.cmd_bench import BenchSettings

    with pytest.raises(BadInput, match=r"test pp8\+tg8 needs 16 tokens, more than the context \(-c 12\)"):
        BenchSettings(n_prompt=(), n_gen=(), pg=((8, 8),), n_ctx=12).configs()
    with pytest.raises(BadInput, match=r"test tg4 @ d10 needs 14 tokens"):
        BenchSettings(n_prompt=(), n_gen=(4,), n_depth=(10,), n_ctx=12).configs()
    with pytest.raises(BadInput, match="no test to run"):
        BenchSettings(n_prompt=(0,), n_gen=(0,)).configs()


def test_markdown_columns_follow_llama_bench_rule():
    """threads always (a CPU backend), ngl where a device exists, other options when not at their default."""
    from ggrun.cli.cmd_bench import BenchSettings

    assert BenchSettings().md_columns(device=False) == ("n_threads",)
    assert BenchSettings().md_columns(device=True) == ("n_gpu_layers", "n_threads")
    assert BenchSettings(n_batch=(128, 256), flash_attn=(0, 1)).md_columns(False) == \
        ("n_threads", "n_batch", "flash_attn")
    assert BenchSettings(n_ubatch=(256,), graph_reuse=(False,)).md_columns(False) == \
        ("n_threads", "n_ubatch", "graph_reuse")
    assert BenchSettings(poll=50).md_columns(False) == ("n_threads",)  # llama-bench's default level
    assert BenchSettings(poll=0).md_columns(False) == ("n_threads", "poll")


def test_poll_reaches_the_threads_and_the_table(app, tiny, monkeypatch):
    """--poll 0: the level in force, and its column in the table as llama-bench adds one off its default."""
    monkeypatch.setattr(threads, "_poll", threads.poll())  # the level this test sets is undone after it
    lines = invoke(app, ["-m", tiny["path"], *SMALL, "--poll", "0"]).splitlines()
    assert jit.poll() == 0
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[head.index("threads") + 1] == "poll"
    assert all(row.split("|")[head.index("poll") + 1].strip() == "0" for row in lines[2:4])


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

    from ggrun.cli.bench_output import Printer

    printer = Printer("md", parse_settings(app[1].settings, args).md_columns(device=False), io.StringIO())
    printer.row(rows[0] | {"test_time": "", "avg_ns": 0, "stddev_ns": 0})
    header = printer.out.getvalue().splitlines()[0]
    assert [c.strip() for c in header.strip("|").split("|")] == \
        ["model", "size", "params", "backend", "threads", "n_batch", "n_ubatch", "reuse", "test", "t/s"]


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
    (["-c", "8", "-n", "16"], "test tg16 needs 16 tokens, more than the context (-c 8)"),
    (["-c", "10", "-pg", "8,4"], "test pp8+tg4 needs 12 tokens, more than the context (-c 10)"),
    (["-c", "10", "-d", "4"], "test pp8 @ d4 needs 12 tokens, more than the context (-c 10)"),
    (["-r", "0"], "-r 0 must be positive"),
    (["-o", "xml"], "-o xml: choose one of md, csv, json, jsonl, sql"),
    (["-p", "8,x"], "-p 8,x: expected integers or ranges (first-last, first-last+step, first-last*mult)"),
    (["-p", "8-64|2"], "-p 8-64|2: a range steps by +N or *N"),
    (["-p", "8-64*1"], "-p 8-64*1: the range 8-64*1 does not advance"),
    (["-t", "0,2"], "-t 0,2: values must be at least 1"),
    (["-fa", "maybe"], "-fa 'maybe': give on, off or auto"),
    (["-ctk", "q9_9"], "-ctk 'q9_9': allowed values are"),
    (["--graph-reuse", "2"], "--graph-reuse 2: values must be 0 or 1"),
    (["-pg", "8"], "-pg 8: expected PP,TG (two integers)"),
    (["--poll", "101"], "--poll 101 must be a level from 0 to 100"),
    (["--poll", "-1"], "--poll -1: expected integers or ranges"),
    (["--poll", "0,50"], "--poll 0,50: ggrun bench takes one level"),
    (["--batched", "--poll", "101"], "--poll 101 must be a level from 0 to 100"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_options_fail_before_loading(app, tiny, nothing_runs, monkeypatch, capsys, args, message):
    code, out, err = run_main(monkeypatch, capsys, ["-m", tiny["path"], *SMALL, *args])
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {message}"), err


@pytest.mark.parametrize("kind", ["missing", "garbage", "truncated", "folder"])
def test_unreadable_model_fails_before_any_model_is_loaded(app, tiny, unreadable, nothing_runs, monkeypatch,
                                                           capsys, kind):
    """Even after a good model in the list: nothing is benchmarked when one model cannot be read."""
    bad = unreadable[kind]
    code, out, err = run_main(monkeypatch, capsys, ["-m", f"{tiny['path']},{bad}", *SMALL])
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and bad in err, err


def test_exit_code_and_message_of_the_real_process(tiny):
    args = ["-m", tiny["path"], *SMALL, "-c", "8", "-n", "16"]
    proc = ggrun_process("bench", *args, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == \
        (2, "", "error: test tg16 needs 16 tokens, more than the context (-c 8)\n")
