"""`ggrun bench`'s output formats, written as llama-bench writes them: md (its table, with its column
widths and its rule for which columns to show), csv (every value quoted), json, jsonl and sql. Rows are
printed as each test finishes; the header waits for the first row, so a run stopped before any row
prints nothing.

Fields are llama-bench's, in its order, where ggrun has the same thing, then ggrun's own (graph_reuse,
n_ctx, numerics, ggrun_version). The SQL table is `ggrun_bench`, so ggrun's rows never collide with
llama-bench's `llama_bench` table in one database.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import TextIO

from ggrun.core.llm.bench import BenchTest

LLAMA_FIELDS = ("build_commit", "cpu_info", "gpu_info", "backends", "model_filename", "model_type", "model_size",
                "model_n_params", "n_batch", "n_ubatch", "n_threads", "poll", "type_k", "type_v", "n_gpu_layers",
                "split_mode", "main_gpu", "flash_attn", "devices", "tensor_split", "n_prompt", "n_gen", "n_depth",
                "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts")
GGRUN_FIELDS = ("ggrun_version", "n_ctx", "graph_reuse", "numerics")
FIELDS = LLAMA_FIELDS + GGRUN_FIELDS
INT_FIELDS = {"model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "poll", "n_gpu_layers", "main_gpu", "flash_attn",
              "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns", "n_ctx", "graph_reuse"}
FLOAT_FIELDS = {"avg_ts", "stddev_ts"}
FORMATS = ("md", "csv", "json", "jsonl", "sql")

# markdown: llama-bench's widths (negative: left-aligned) and display names
WIDTHS = {"model": -30, "size": 10, "params": 10, "backend": -10, "n_gpu_layers": 3, "n_threads": 7, "poll": 10, "n_batch": 7,
          "n_ubatch": 8, "type_k": 6, "type_v": 6, "split_mode": -10, "main_gpu": 10, "flash_attn": 3,
          "devices": -10, "tensor_split": -12, "graph_reuse": 5, "test": 15, "t/s": 20}
NAMES = {"n_gpu_layers": "ngl", "n_threads": "threads", "split_mode": "sm", "flash_attn": "fa", "devices": "dev",
         "tensor_split": "ts", "graph_reuse": "reuse"}


@dataclass
class Printer:
    """Writes rows in one format; `columns` are the markdown table's optional columns, in order."""

    fmt: str
    columns: tuple[str, ...] = ()
    out: TextIO = field(default_factory=lambda: sys.stdout)
    rows: int = 0

    def row(self, r: dict) -> None:
        if self.rows == 0:
            self.out.write(self._header())
        elif self.fmt == "json":
            self.out.write(",\n")
        self.out.write(self._row(r))
        self.out.flush()
        self.rows += 1

    def footer(self, build: str) -> None:
        """The end of the output: json's closing bracket, the table's build line; nothing without rows."""
        if not self.rows:
            return
        if self.fmt == "json":
            self.out.write("\n]\n")
        elif self.fmt == "md":
            self.out.write(f"\nbuild: {build}\n")
        self.out.flush()

    def _header(self) -> str:
        if self.fmt == "csv":
            return ",".join(FIELDS) + "\n"
        if self.fmt == "json":
            return "[\n"
        if self.fmt == "sql":
            cols = ",\n".join(f"  {f} {sql_type(f)}" for f in FIELDS)
            return f"CREATE TABLE IF NOT EXISTS ggrun_bench (\n{cols}\n);\n\n"
        if self.fmt == "md":
            cols = self.md_columns()
            head = "|" + "".join(f" {_pad(NAMES.get(c, c), WIDTHS[c])} |" for c in cols)
            rule = "|" + "".join(f" {'-' * (abs(WIDTHS[c]) - 1)}{':' if WIDTHS[c] > 0 else '-'} |" for c in cols)
            return head + "\n" + rule + "\n"
        return ""

    def _row(self, r: dict) -> str:
        if self.fmt == "csv":
            return ",".join('"' + str(csv_value(f, r[f])).replace('"', '""') + '"' for f in FIELDS) + "\n"
        if self.fmt == "json":
            body = ",\n".join(f'    "{f}": {json.dumps(r[f])}' for f in FIELDS)
            return (f"  {{\n{body},\n    \"samples_ns\": {json.dumps(r['samples_ns'])},\n"
                    f"    \"samples_ts\": {json.dumps(r['samples_ts'])}\n  }}")
        if self.fmt == "jsonl":
            return json.dumps({f: r[f] for f in FIELDS} | {"samples_ns": r["samples_ns"],
                                                            "samples_ts": r["samples_ts"]}) + "\n"
        if self.fmt == "sql":
            values = ", ".join("'" + str(csv_value(f, r[f])).replace("'", "''") + "'" for f in FIELDS)
            return f"INSERT INTO ggrun_bench ({', '.join(FIELDS)}) VALUES ({values});\n"
        cells = [md_value(c, r) for c in self.md_columns()]
        # widths count characters ('±' is one; llama-bench pads its two bytes by one more, to the same look)
        return "|" + "".join(f" {_pad(v, WIDTHS[c])} |" for c, v in zip(self.md_columns(), cells)) + "\n"

    def md_columns(self) -> list[str]:
        return ["model", "size", "params", "backend", *self.columns, "test", "t/s"]


def _pad(text: str, width: int) -> str:
    return text.ljust(-width) if width < 0 else text.rjust(width)


def sql_type(f: str) -> str:
    return "INTEGER" if f in INT_FIELDS else "REAL" if f in FLOAT_FIELDS else "TEXT"


def csv_value(f: str, v) -> str:
    """A value as llama-bench's get_values spells it: %f for floats, integers as they are."""
    if f in FLOAT_FIELDS:
        return f"{v:f}"
    return str(int(v)) if isinstance(v, bool) else str(v)


def md_value(column: str, r: dict) -> str:
    """A markdown cell as llama-bench prints it (sizes in MiB/GiB, parameters in M/B, t/s with ±)."""
    if column == "model":
        return r["model_type"]
    if column == "size":
        size = r["model_size"]
        return f"{size / 2**20:.2f} MiB" if size < 2**30 else f"{size / 2**30:.2f} GiB"
    if column == "params":
        n = r["model_n_params"]
        return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"
    if column == "backend":
        return r["backends"]
    if column == "test":
        return test_label(r["n_prompt"], r["n_gen"], r["n_depth"])
    if column == "t/s":
        return f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"
    return str(r[column])


def test_label(n_prompt: int, n_gen: int, n_depth: int) -> str:
    return BenchTest(n_prompt, n_gen, n_depth).label


def speeds_of(stdout: str, tool: str) -> dict[str, float]:
    """t/s of each test (test_label: pp512, tg128, ...) in the JSON list llama-bench -o json prints, which
    `ggrun bench -o json` prints too: what the side-by-side scripts compare. Output that is not such a list
    ends the script with one line naming `tool`."""
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"{tool} printed no JSON: {stdout[-1000:]!r}") from None
    return {test_label(r["n_prompt"], r["n_gen"], r.get("n_depth", 0)): float(r["avg_ts"]) for r in rows}
