"""`ggrun bench --batched` end to end on a synthetic tiny llama: llama-batched-bench's rows (its order, its
N_KV with and without -pps, rows that do not fit the context skipped), its md table and jsonl records, the
json list, and bad options that exit 2 with one line."""
from __future__ import annotations

import json

import pytest

from tests.cli.runner import ggrun

HEADER = "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
KEYS = {"n_kv_max", "n_batch", "n_ubatch", "flash_attn", "is_pp_shared", "n_gpu_layers", "n_threads",
        "n_threads_batch", "pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed"}


def records(monkeypatch, capsys, model, *args: str) -> list[dict]:
    code, out, err = ggrun(capsys, monkeypatch, "bench", "--batched", "-m", str(model), "-o", "jsonl", *args)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_md_table_is_llama_batched_benchs(monkeypatch, capsys, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "bench", "--batched", "-m", str(tiny_llama_path), "-npp", "8,16",
                           "-ntg", "4", "-npl", "1,3")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("main: n_kv_max = 60, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0")
    assert lines[2] == HEADER and lines[3] == "|" + "|".join("-" * (w + 2) for w in (6, 6, 4, 6, 8, 8, 8, 8, 8, 8))[1:] + "|"
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[4:]]
    assert [r[:4] for r in rows] == [["8", "4", "1", "12"], ["8", "4", "3", "36"], ["16", "4", "1", "20"],
                                     ["16", "4", "3", "60"]]
    for r in rows:  # the figures are printed rounded (a warmed-up tiny row's times to 0.000): their arithmetic
        assert all(float(x) >= 0 for x in r[4:]) and all(float(r[i]) > 0 for i in (5, 7, 9))  # is checked on jsonl


def test_no_warmup_measures_rows_cold(monkeypatch, capsys, tiny_llama_path):
    """--no-warmup is taken with --batched (as llama-bench's), and the rows are measured all the same."""
    recs = records(monkeypatch, capsys, tiny_llama_path, "-npp", "8", "-ntg", "2", "-npl", "1,2", "--no-warmup")
    assert [r["pl"] for r in recs] == [1, 2] and all(r["speed_tg"] > 0 for r in recs)


def test_jsonl_records_shared_prompt_and_skipped_rows(monkeypatch, capsys, tiny_llama_path):
    recs = records(monkeypatch, capsys, tiny_llama_path, "-npp", "10", "-ntg", "3", "-npl", "1,2,4,8", "-pps",
                   "-c", "30")
    assert [r["pl"] for r in recs] == [1, 2, 4]  # 8 sequences would need 10 + 8 * 3 = 34 cells
    for r in recs:
        assert KEYS <= set(r)
        assert r["is_pp_shared"] == 1 and r["n_kv_max"] == 30
        assert r["n_kv"] == 10 + r["pl"] * 3
        assert r["speed_pp"] == pytest.approx(10 / r["t_pp"], rel=1e-6)
        assert r["speed_tg"] == pytest.approx(r["pl"] * 3 / r["t_tg"], rel=1e-6)
        assert r["t"] == pytest.approx(r["t_pp"] + r["t_tg"], rel=1e-9)
        assert r["speed"] == pytest.approx(r["n_kv"] / r["t"], rel=1e-6)


def test_json_is_one_list(monkeypatch, capsys, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "bench", "--batched", "-m", str(tiny_llama_path), "-npp", "4",
                           "-ntg", "2", "-npl", "2", "-o", "json")
    assert code == 0, err
    recs = json.loads(out)
    assert len(recs) == 1 and recs[0]["pl"] == 2 and recs[0]["n_kv"] == 12


@pytest.mark.parametrize("args,words", [
    (["-npl", "0"], "-npl"),
    (["-npp", "10", "-ntg", "10", "-npl", "4", "-c", "16"], "no row fits"),
    (["-o", "csv"], "-o csv"),
    (["-t", "1,2"], "-t 1,2"),
])
def test_bad_options_exit_2_with_one_line(monkeypatch, capsys, tiny_llama_path, args, words):
    code, out, err = ggrun(capsys, monkeypatch, "bench", "--batched", "-m", str(tiny_llama_path), *args)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_batched_options_need_batched(monkeypatch, capsys, tiny_llama_path):
    code, _, err = ggrun(capsys, monkeypatch, "bench", "-m", str(tiny_llama_path), "-npl", "4")
    assert code == 2 and "--batched" in err
