"""Ctrl-C (cli/interrupt.py): the first one ends a command at its next micro-batch with what it has
(`run`: the text so far and its newline, the timings, `interrupted`, exit 130; `parallel`: the finished
sequences and the summary so far; `bench`: the rows measured; `perplexity`: the estimate so far), a
second one exits at once. `run` is interrupted for real with SIGINT in a process of its own; the
other commands in this process, where a hook raises SIGINT at a chosen moment."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from ggrun.cli.interrupt import Interrupt
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.errors import Interrupted
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from tests.cli.runner import ENTRY, REPO, ggrun
from tests.cli.test_cli_run import TIMING_LABELS, timings


def test_run_process_interrupted_by_sigint_mid_generation(tiny_llama_path):
    """SIGINT once tokens are streaming: the text ends with a newline, the timings so far are printed, then
    `interrupted`, exit 130. --context-shift with a huge -n keeps generation going until the signal."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    args = ["run", "-m", str(tiny_llama_path), "-p", "hello", "-n", "100000000", "-c", "128", "--ignore-eos",
            "--context-shift", "-s", "1", "--no-display-prompt"]  # the first text out is a generated token
    proc = subprocess.Popen([*ENTRY, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks: list[bytes] = []
    first = threading.Event()

    def read() -> None:
        while data := os.read(proc.stdout.fileno(), 4096):
            chunks.append(data)
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first.wait(300), "no token came out"
        time.sleep(0.2)  # well into generation
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    out = b"".join(chunks).decode("utf-8", "replace")
    err = proc.stderr.read().decode("utf-8", "replace")
    assert code == 130, err
    assert "Traceback" not in err
    assert out.endswith("\n") and len(out) > 1
    assert err.splitlines()[-1] == "interrupted"
    found = timings(err)
    assert set(TIMING_LABELS) <= set(found), err
    n_eval = int(found["eval time"].split("/")[1].split()[0])
    assert n_eval > 0


def test_second_ctrl_c_exits_at_once(monkeypatch):
    """The first SIGINT only asks; the second, before any safe point came, exits with 130 there and then."""
    exits: list[int] = []
    written: list[bytes] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(os, "write", lambda fd, data: written.append(data) or len(data))
    with Interrupt() as stop:
        assert not stop() and signal.getsignal(signal.SIGINT) == stop._on_sigint
        stop._on_sigint(signal.SIGINT, None)
        assert stop() and exits == []
        with pytest.raises(SystemExit):
            stop._on_sigint(signal.SIGINT, None)
    assert exits == [130] and written == [b"\ninterrupted\n"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored on leaving


def test_rearming_clears_the_request_and_an_ignored_sigint_stays_ignored():
    stop = Interrupt()
    with stop:
        stop._on_sigint(signal.SIGINT, None)
    with stop:  # a conversation arms it again for the next reply
        assert not stop()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Interrupt():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_session_stops_before_a_micro_batch_and_keeps_what_it_computed(tiny_llama_path):
    """The poll comes before each micro-batch: with a stop asked after the first of three, the cache holds
    exactly that micro-batch's tokens, and a later decode goes on from there."""
    s = Session(Model.load(tiny_llama_path, [CPUBackend()]), SessionParams(n_ctx=64, n_batch=64, n_ubatch=4))
    asked = []
    s.interrupt = lambda: len(asked) > 0
    compute = s.sched.compute

    def compute_then_ask(sg):
        compute(sg)
        asked.append(True)

    s.sched.compute = compute_then_ask
    with pytest.raises(Interrupted):
        s.decode(Batch.of_sequence(list(range(65, 77)), 0))
    assert s.kv.n_used == 4 and s.stats.n_tokens == 4
    s.interrupt = None
    logits = s.decode(Batch.of_sequence([77], 4))
    assert logits.shape == (1, s.model.hp.n_vocab)


def _raise_sigint_after(calls: int, fn):
    """fn wrapped so that its `calls`-th call, once done, raises SIGINT in this process (as Ctrl-C would)."""
    count = [0]

    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        count[0] += 1
        if count[0] == calls:
            signal.raise_signal(signal.SIGINT)
        return result

    return wrapped


def test_parallel_prints_finished_sequences_and_the_summary_so_far(capsys, monkeypatch, tiny_llama_path):
    from ggrun.cli import cmd_parallel

    monkeypatch.setattr(cmd_parallel, "_print_result", _raise_sigint_after(1, cmd_parallel._print_result))
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", tiny_llama_path, "-np", "2", "-ns", "6",
                           "-n", "8", "-c", "1024", "--temp", "0", "--json", "--no-system-prompt")
    assert code == 130, err
    assert err.splitlines()[-1] == "interrupted" and "Traceback" not in err
    lines = [json.loads(line) for line in out.splitlines()]
    seqs, summary = lines[:-1], lines[-1]
    assert 1 <= len(seqs) < 6
    assert summary["interrupted"] and summary["sequences"] == 6 and summary["sequences_done"] == len(seqs)
    assert summary["n_gen"] == sum(r["n_response"] for r in seqs)


def test_parallel_text_summary_says_interrupted(capsys, monkeypatch, tiny_llama_path):
    from ggrun.cli import cmd_parallel

    monkeypatch.setattr(cmd_parallel, "_print_result", _raise_sigint_after(1, cmd_parallel._print_result))
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", tiny_llama_path, "-np", "2", "-ns", "6",
                           "-n", "8", "-c", "1024", "--temp", "0", "--no-system-prompt")
    assert code == 130, err
    assert "Interrupted after " in out and " of 6 sequences" in out and "Total gen tokens:" in out


def test_bench_prints_the_rows_already_measured(capsys, monkeypatch, tiny_llama_path):
    from ggrun.cli import cmd_bench

    monkeypatch.setattr(cmd_bench, "run_bench", _raise_sigint_after(1, cmd_bench.run_bench))
    code, out, err = ggrun(capsys, monkeypatch, "bench", "-m", tiny_llama_path, "-p", "8,16", "-n", "4", "-r", "1",
                           "-o", "jsonl")
    assert code == 130, err
    assert err.splitlines()[-1] == "interrupted" and "Traceback" not in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(8, 0)]


def test_bench_interrupted_before_any_row_prints_no_table(capsys, monkeypatch, tiny_llama_path):
    from ggrun.core.llm import bench as core_bench

    monkeypatch.setattr(core_bench, "run_once", _raise_sigint_after(1, core_bench.run_once))
    code, out, err = ggrun(capsys, monkeypatch, "bench", "-m", tiny_llama_path, "-p", "8", "-n", "0", "-r", "3")
    assert code == 130, err
    assert out == "" and err.splitlines()[-1] == "interrupted"


def test_perplexity_prints_the_estimate_so_far(capsys, monkeypatch, tiny_llama_path, tmp_path):
    from ggrun.cli import cmd_perplexity

    text = tmp_path / "text.txt"
    text.write_text("the world is in the hello world of the tiny model " * 8, encoding="utf-8")
    monkeypatch.setattr(cmd_perplexity, "token_nll", _raise_sigint_after(2, cmd_perplexity.token_nll))
    code, out, err = ggrun(capsys, monkeypatch, "perplexity", "-m", tiny_llama_path, "-f", text, "-c", "16",
                           "-o", "json")
    assert code == 130, err
    assert err.splitlines()[-1] == "interrupted"
    record = json.loads(out)
    assert record["interrupted"] and record["n_chunks"] == 2 and record["chunks_total"] > 2
    assert record["n_tokens"] == 2 * 7 and record["perplexity"] > 1  # chunks of 16 score tokens 9..15
