"""`ggrun parallel` end to end on a synthetic tiny llama: JSON lines and text output, prompts from a
file, a small cache that makes sequences wait, a prompt that can never fit, and bad options that exit
2 with one line."""
from __future__ import annotations

import json

import pytest

from tests.cli.runner import ggrun
from ggrun.cli.cmd_parallel import QUESTIONS

SEQUENCE_KEYS = {"client", "seq", "input", "response", "response_tokens", "n_prompt", "n_response", "seconds"}
SUMMARY_KEYS = {"prompt_tps", "gen_tps", "total_tps", "cache_misses", "graphs_reused"}


def parallel_json(monkeypatch, capsys, model, *args: str) -> tuple[list[dict], dict]:
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", str(model), "--temp", "0", "--json", *args)
    assert code == 0, err
    lines = [json.loads(ln) for ln in out.splitlines()]  # stdout holds JSON lines only
    assert lines, err
    return lines[:-1], lines[-1]


def test_json_lines(monkeypatch, capsys, tiny_llama_path):
    seqs, summary = parallel_json(monkeypatch, capsys, tiny_llama_path, "-np", "3", "-ns", "5", "-n", "6",
                                  "-c", "1024")
    assert len(seqs) == 5
    assert sorted(r["seq"] for r in seqs) == list(range(5))
    for r in seqs:
        assert SEQUENCE_KEYS <= set(r) and "skipped" not in r
        assert r["input"] == QUESTIONS[r["seq"]]
        assert 0 <= r["client"] < 3
        assert r["n_response"] == len(r["response_tokens"]) <= 6
        assert r["n_prompt"] > 0 and r["seconds"] >= 0 and isinstance(r["response"], str)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["cache_misses"] == 0
    assert summary["graphs_reused"] > 0
    assert summary["gen_tps"] > 0 and summary["prompt_tps"] > 0 and summary["total_tps"] > 0
    assert summary["n_gen"] == sum(r["n_response"] for r in seqs)


def test_clients_do_not_change_greedy_responses(monkeypatch, capsys, tiny_llama_path):
    """The same sequences served by 1 client or by 4 at once get the same tokens (--temp 0)."""
    runs = {}
    for np_ in ("1", "4"):
        seqs, _ = parallel_json(monkeypatch, capsys, tiny_llama_path, "-np", np_, "-ns", "6", "-n", "5",
                                "-c", "1024", "--ignore-eos")
        runs[np_] = {r["seq"]: r["response_tokens"] for r in seqs}
    assert runs["1"] == runs["4"]
    assert all(len(t) == 5 for t in runs["1"].values())


def test_text_output(monkeypatch, capsys, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", str(tiny_llama_path), "-np", "2", "-ns", "3",
                           "-n", "4", "-c", "1024", "--temp", "0")
    assert code == 0, err
    for seq in range(3):
        assert f", seq {seq:4d}, prompt " in out
    assert out.count("Client ") == 3 and out.count("Input:    ") == 3 and out.count("Response: ") == 3
    for label in ("Total prompt tokens:", "Total gen tokens:", "Total speed (AVG):", "Cache misses:",
                  "Graphs reused:"):
        assert label in out
    assert "serving 3 sequences with 2 clients" in err
    assert "Client" not in err  # results on stdout, logs on stderr


def test_prompts_from_file(monkeypatch, capsys, tiny_llama_path, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first question\n\n  second question  \n", encoding="utf-8")
    seqs, summary = parallel_json(monkeypatch, capsys, tiny_llama_path, "-f", str(f), "-np", "2", "-ns", "3",
                                  "-n", "3", "-c", "1024")
    assert [r["input"] for r in sorted(seqs, key=lambda r: r["seq"])] == ["first question", "second question",
                                                                          "first question"]


def test_small_cache_waits(monkeypatch, capsys, tiny_llama_path):
    """-c leaves room for about two sequences beside the 490-token system prompt: the others wait for
    cells (cache misses) and every sequence still completes, with the tokens of a roomy run."""
    args = ("-np", "4", "-ns", "6", "-n", "5", "--ignore-eos")
    roomy, _ = parallel_json(monkeypatch, capsys, tiny_llama_path, *args, "-c", "2048")
    tight, summary = parallel_json(monkeypatch, capsys, tiny_llama_path, *args, "-c", "640")
    assert summary["cache_misses"] > 0
    assert not any("skipped" in r for r in tight)
    assert {r["seq"]: r["response_tokens"] for r in tight} == {r["seq"]: r["response_tokens"] for r in roomy}


def test_prompt_that_never_fits_is_skipped(monkeypatch, capsys, tiny_llama_path, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("short one\n" + "word " * 200 + "\nanother short one\n", encoding="utf-8")
    seqs, summary = parallel_json(monkeypatch, capsys, tiny_llama_path, "-f", str(f), "-np", "2", "-ns", "3",
                                  "-n", "4", "-c", "640")
    by_seq = {r["seq"]: r for r in seqs}
    assert sorted(by_seq) == [0, 1, 2]
    assert "cells" in by_seq[1]["skipped"] and by_seq[1]["response_tokens"] == []
    assert "skipped" not in by_seq[0] and "skipped" not in by_seq[2]
    assert summary["n_gen"] == by_seq[0]["n_response"] + by_seq[2]["n_response"]
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", str(tiny_llama_path), "-f", str(f), "-np", "2",
                           "-ns", "3", "-n", "4", "-c", "640")
    assert code == 0, err
    assert "seq    1: skipped: needs" in out and "Total gen tokens:" in out


@pytest.mark.parametrize("args,words", [
    (("-np", "0"), "-np 0"),
    (("-ns", "0"), "-ns 0"),
    (("-n", "0"), "-n 0"),
    (("-c", "-5"), "-c -5"),
    (("-f", "/nonexistent/prompts.txt"), "/nonexistent/prompts.txt"),
    (("--temp", "-1"), "--temp"),
    (("-c", "64"), "system prompt"),
], ids=["np0", "ns0", "n0", "c-neg", "missing-file", "temp", "system-too-long"])
def test_bad_options_exit_2_with_one_line(monkeypatch, capsys, tiny_llama_path, args, words):
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", str(tiny_llama_path), *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    assert "Traceback" not in err and out == ""


def test_empty_prompt_file(monkeypatch, capsys, tiny_llama_path, tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("\n  \n", encoding="utf-8")
    code, _, err = ggrun(capsys, monkeypatch, "parallel", "-m", str(tiny_llama_path), "-f", str(f))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no prompts" in err
