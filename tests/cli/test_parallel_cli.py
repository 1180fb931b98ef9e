"""`ggrun parallel` end to end on a synthetic tiny llama: llama-parallel's requests (its questions drawn
in its order, the system prompt in every request or shared with -pps), its report lines and summary,
JSON lines, prompts from a file, a small cache that makes sequences wait, a prompt that can never fit,
and bad options that exit 2 with one line."""
from __future__ import annotations

import json
import re

import pytest

from ggrun.cli.parallel_prompts import QUESTIONS, SYSTEM_PROMPT, make_requests
from tests.cli.runner import ggrun

SEQUENCE_KEYS = {"client", "seq", "input", "response", "response_tokens", "n_prompt", "n_response", "seconds"}
SUMMARY_KEYS = {"prompt_tps", "gen_tps", "total_tps", "cache_misses", "graphs_reused", "n_prompt", "n_gen"}
NO_SYSTEM = "--no-system-prompt"  # the tiny tokenizer makes llama-parallel's system prompt ~1000 tokens


def parallel_json(monkeypatch, capsys, model, *args: str) -> tuple[list[dict], dict]:
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", str(model), "--temp", "0", "--json", *args)
    assert code == 0, err
    lines = [json.loads(ln) for ln in out.splitlines()]  # stdout holds JSON lines only
    assert lines, err
    return lines[:-1], lines[-1]


def test_json_lines_serve_llama_parallel_requests(monkeypatch, capsys, tiny_llama_path):
    seqs, summary = parallel_json(monkeypatch, capsys, tiny_llama_path, "-np", "3", "-ns", "5", "-n", "6",
                                  "-c", "1024", NO_SYSTEM)
    assert len(seqs) == 5
    assert sorted(r["seq"] for r in seqs) == list(range(5))
    want = [r.question for r in make_requests(5, QUESTIONS)]
    assert want[:3] == [QUESTIONS[6], QUESTIONS[3], QUESTIONS[8]]  # std::mt19937(1234)'s draws, as llama-parallel
    for r in seqs:
        assert SEQUENCE_KEYS <= set(r) and "skipped" not in r
        assert r["input"] == want[r["seq"]]
        assert 0 <= r["client"] < 3
        assert r["n_response"] == len(r["response_tokens"]) <= 6
        assert r["n_prompt"] > 0 and r["seconds"] >= 0 and isinstance(r["response"], str)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["cache_misses"] == 0
    assert summary["graphs_reused"] > 0
    assert summary["gen_tps"] > 0 and summary["prompt_tps"] > 0 and summary["total_tps"] > 0
    assert summary["n_gen"] == sum(r["n_response"] for r in seqs)
    assert summary["n_prompt"] == sum(r["n_prompt"] for r in seqs)
    # llama-parallel's arithmetic: each speed is its tokens over the whole run
    assert summary["gen_tps"] == pytest.approx(summary["n_gen"] / summary["seconds"])
    assert summary["total_tps"] == pytest.approx((summary["n_gen"] + summary["n_prompt"]) / summary["seconds"])


def test_system_prompt_is_in_every_request_unless_shared(monkeypatch, capsys, tiny_llama_path):
    """Without -pps each request holds the system prompt's tokens (no BOS, as llama-parallel); with -pps
    they are evaluated once and the requests hold only their turn."""
    args = ("-np", "2", "-ns", "2", "-n", "2", "-c", "2600")
    inline, s1 = parallel_json(monkeypatch, capsys, tiny_llama_path, *args)
    shared, s2 = parallel_json(monkeypatch, capsys, tiny_llama_path, *args, "-pps")
    from ggrun.core.backends.cpu import CPUBackend
    from ggrun.core.llm.model import Model

    tok = Model.load(tiny_llama_path, [CPUBackend()], metadata_only=True).tokenizer
    n_system = len(tok.tokenize(SYSTEM_PROMPT, add_special=False, parse_special=False))
    for a, b in zip(sorted(inline, key=lambda r: r["seq"]), sorted(shared, key=lambda r: r["seq"])):
        assert a["n_prompt"] == b["n_prompt"] + n_system
    assert s1["n_system"] == 0
    assert s2["n_system"] == len(tok.tokenize(SYSTEM_PROMPT, add_special=True, parse_special=False))


def test_clients_do_not_change_greedy_responses(monkeypatch, capsys, tiny_llama_path):
    """The same sequences served by 1 client or by 4 at once, their prompts read whole or in chunks of 4
    tokens per step, get the same tokens (--temp 0)."""
    runs = {}
    for np_, chunk in (("1", "0"), ("4", "0"), ("4", "4")):
        seqs, _ = parallel_json(monkeypatch, capsys, tiny_llama_path, "-np", np_, "-ns", "6", "-n", "5",
                                "-c", "1024", "--ignore-eos", NO_SYSTEM, "--prefill-chunk", chunk)
        runs[np_, chunk] = {r["seq"]: r["response_tokens"] for r in seqs}
    assert runs["1", "0"] == runs["4", "0"] == runs["4", "4"]
    assert all(len(t) == 5 for t in runs["1", "0"].values())


def test_text_output_is_llama_parallel_report(monkeypatch, capsys, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", str(tiny_llama_path), "-np", "2", "-ns", "3",
                           "-n", "4", "-c", "1024", "--temp", "0", NO_SYSTEM)
    assert code == 0, err
    heads = re.findall(r"^Client +(\d+), seq +(\d+)/  3, prompt +\d+ t, response +\d+ t, time +[\d.]+ s, "
                       r"speed +[\d.]+ t/s, cache miss 0$", out, flags=re.MULTILINE)
    assert sorted(int(s) for _, s in heads) == [0, 1, 2]
    assert out.count("\nInput:    ") == 3 and out.count("\nResponse: ") == 3
    summary = out.splitlines()[-6:]
    assert re.fullmatch(r"Total prompt tokens: +\d+, speed: +[\d.]+ t/s", summary[0])
    assert re.fullmatch(r"Total gen tokens: +\d+, speed: +[\d.]+ t/s", summary[1])
    assert re.fullmatch(r"Total speed \(AVG\): +speed: +[\d.]+ t/s", summary[2])
    assert re.fullmatch(r"Cache misses: +0", summary[3])
    assert re.fullmatch(r"Prompt tokens shared: *\d+", summary[4])
    assert re.fullmatch(r"Graphs reused: +\d+", summary[5])
    assert "n_parallel = 2, n_sequences = 3, cont_batching = 1, system tokens = 0" in err
    assert "Client" not in err  # results on stdout, logs on stderr


def test_prompts_from_file(monkeypatch, capsys, tiny_llama_path, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first question\n\n  second question  \n", encoding="utf-8")
    seqs, summary = parallel_json(monkeypatch, capsys, tiny_llama_path, "-f", str(f), "-np", "2", "-ns", "3",
                                  "-n", "3", "-c", "1024", NO_SYSTEM)
    want = [r.question for r in make_requests(3, ["first question", "second question"])]
    assert [r["input"] for r in sorted(seqs, key=lambda r: r["seq"])] == want


def test_small_cache_waits(monkeypatch, capsys, tiny_llama_path):
    """A cache with room for about two of the four clients' sequences: the others wait for cells (cache
    misses) and every sequence still completes, with the tokens of a roomy run."""
    args = ("-np", "4", "-ns", "6", "-n", "5", "--ignore-eos", NO_SYSTEM)
    roomy, _ = parallel_json(monkeypatch, capsys, tiny_llama_path, *args, "-c", "2048")
    tight, summary = parallel_json(monkeypatch, capsys, tiny_llama_path, *args, "-c", "100")
    assert summary["cache_misses"] > 0
    assert not any("skipped" in r for r in tight)
    assert {r["seq"]: r["response_tokens"] for r in tight} == {r["seq"]: r["response_tokens"] for r in roomy}


def test_prompt_that_never_fits_is_skipped(monkeypatch, capsys, tiny_llama_path, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("short one\n" + "word " * 200 + "\n", encoding="utf-8")
    seqs, summary = parallel_json(monkeypatch, capsys, tiny_llama_path, "-f", str(f), "-np", "2", "-ns", "3",
                                  "-n", "4", "-c", "200", NO_SYSTEM)
    long = "word " * 199 + "word"
    by_seq = {r["seq"]: r for r in seqs}
    assert sorted(by_seq) == [0, 1, 2]
    for r in by_seq.values():
        if r["input"] == long:
            assert "cells" in r["skipped"] and r["response_tokens"] == []
        else:
            assert "skipped" not in r
    assert any("skipped" in r for r in seqs)
    assert summary["n_gen"] == sum(r["n_response"] for r in seqs)


@pytest.mark.parametrize("args,words", [
    (("-np", "0"), "-np 0"),
    (("-ns", "0"), "-ns 0"),
    (("-n", "-3"), "-n -3"),
    (("-c", "-5"), "-c -5"),
    (("-f", "/nonexistent/prompts.txt"), "/nonexistent/prompts.txt"),
    (("--temp", "-1"), "--temp"),
    (("-c", "64", "-pps"), "system prompt"),
    (("--junk", "-1"), "--junk -1"),
    (("--prefill-chunk", "-1"), "--prefill-chunk -1"),
], ids=["np0", "ns0", "n-neg", "c-neg", "missing-file", "temp", "system-too-long", "junk", "chunk-neg"])
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


def test_a_response_that_uses_up_its_share_of_the_cache_is_told(monkeypatch, capsys, tiny_llama_path):
    """-n 0: a response that never ends by itself stops at its share of the cache, with a line on stderr
    naming the client and sequence, and its JSON record saying why."""
    code, out, err = ggrun(capsys, monkeypatch, "parallel", "-m", str(tiny_llama_path), "--temp", "0", "--json",
                           "-np", "2", "-ns", "3", "-n", "0", "-c", "256", "--ignore-eos", NO_SYSTEM)
    assert code == 0, err
    seqs = [json.loads(ln) for ln in out.splitlines()][:-1]
    assert len(seqs) == 3 and all(r["stop_reason"] for r in seqs)
    told = [r for r in seqs if r["stop_reason"] == "its share of the KV cache is used up"]
    assert told, seqs
    for r in told:
        assert f"seq {r['seq']:3d}: stopped after {r['n_response']} tokens, its share of the KV cache is used up" in err
