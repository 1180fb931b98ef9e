"""cli.bench_output on a fixed row: each format exactly as llama-bench prints it (its markdown widths and
± column, every csv value quoted, %f floats in csv and sql, json's layout), headers only once a row
exists, and the footer only after rows."""
from __future__ import annotations

import io
import json

from ggrun.cli.bench_output import FIELDS, Printer

ROW = {
    "build_commit": "abc1234", "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
    "model_filename": "/m/gemma.gguf", "model_type": "gemma3 270M Q4_K - Medium", "model_size": 246587904,
    "model_n_params": 268098176, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "poll": 50, "type_k": "f16",
    "type_v": "f16", "n_gpu_layers": 0, "split_mode": "layer", "main_gpu": 0, "flash_attn": -1, "devices": "auto",
    "tensor_split": "0.00", "n_prompt": 512, "n_gen": 0, "n_depth": 512,
    "test_time": "2026-01-02T03:04:05Z", "avg_ns": 1000000000, "stddev_ns": 0, "avg_ts": 512.0, "stddev_ts": 0.0,
    "ggrun_version": "0.1.0", "n_ctx": 1024, "graph_reuse": 1, "numerics": "llama",
    "samples_ns": [1000000000], "samples_ts": [512.0],
}


def printed(fmt: str, columns=("n_threads",), rows: int = 1) -> str:
    out = io.StringIO()
    p = Printer(fmt, columns, out)
    for _ in range(rows):
        p.row(ROW)
    p.footer("abc1234 (ggrun 0.1.0)")
    return out.getvalue()


def test_the_poll_column_is_llama_benchs():
    """Width 10, right-aligned (llama-bench's for a field it has no width for), after threads."""
    head, rule, row = printed("md", columns=("n_threads", "poll")).splitlines()[:3]
    assert head.split("|")[5:7] == [" threads ", "       poll "]
    assert rule.split("|")[6] == " ---------: " and row.split("|")[6] == "         50 "


def test_markdown_as_llama_bench():
    """Every cell as wide as llama-bench's (checked against its output on this machine: 30, 10, 10, 10, 7, 15
    and 20 characters between the bars' spaces)."""
    assert printed("md").splitlines() == [
        "| model                          |       size |     params | backend    | threads |            test |"
        "                  t/s |",
        "| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: |"
        " -------------------: |",
        "| gemma3 270M Q4_K - Medium      | 235.16 MiB |   268.10 M | CPU        |       2 |    pp512 @ d512 |"
        "        512.00 ± 0.00 |",
        "",
        "build: abc1234 (ggrun 0.1.0)",
    ]


def test_markdown_split_columns_as_llama_bench():
    """-sm, -mg, -dev and -ts columns (shown when given) with llama-bench's names and widths: sm 10 and dev 10
    left-aligned, main_gpu 10, ts 12 left-aligned."""
    row = ROW | {"split_mode": "row", "main_gpu": 1, "devices": "CUDA0/CUDA1", "tensor_split": "3.00/1.00"}
    out = io.StringIO()
    p = Printer("md", ("n_gpu_layers", "split_mode", "main_gpu", "devices", "tensor_split"), out)
    p.row(row)
    head, rule, line = out.getvalue().splitlines()
    assert head.split("|")[5:10] == [" ngl ", " sm         ", "   main_gpu ", " dev        ", " ts           "]
    assert rule.split("|")[6:10] == [" ---------- ", " ---------: ", " ---------- ", " ------------ "]
    assert line.split("|")[6:10] == [" row        ", "          1 ", " CUDA0/CUDA1 ", " 3.00/1.00    "]


def test_csv_quotes_every_value():
    lines = printed("csv", rows=2).splitlines()
    assert lines[0] == ",".join(FIELDS)
    assert lines[1] == lines[2]
    assert lines[1].startswith('"abc1234","AMD EPYC","","CPU","/m/gemma.gguf","gemma3 270M Q4_K - Medium","246587904",')
    assert '"512.000000","0.000000","0.1.0","1024","1","llama"' in lines[1]


def test_sql_creates_its_own_table_and_inserts_rows():
    text = printed("sql")
    assert text.startswith("CREATE TABLE IF NOT EXISTS ggrun_bench (\n  build_commit TEXT,\n  cpu_info TEXT,\n")
    assert "  avg_ts REAL,\n" in text and "  n_depth INTEGER,\n" in text and "  numerics TEXT\n);\n\n" in text
    insert = text.splitlines()[-1]
    assert insert.startswith(f"INSERT INTO ggrun_bench ({', '.join(FIELDS)}) VALUES ('abc1234', 'AMD EPYC', '', ")
    assert insert.endswith("'512.000000', '0.000000', '0.1.0', '1024', '1', 'llama');")


def test_json_and_jsonl_hold_every_field_and_the_samples():
    rows = json.loads(printed("json", rows=2))
    assert len(rows) == 2 and list(rows[0]) == [*FIELDS, "samples_ns", "samples_ts"] and rows[0] == ROW
    lines = printed("jsonl", rows=2).splitlines()
    assert [json.loads(x) for x in lines] == [ROW, ROW]


def test_nothing_without_rows():
    assert all(printed(fmt, rows=0) == "" for fmt in ("md", "csv", "json", "jsonl", "sql"))
