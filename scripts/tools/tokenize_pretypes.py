#!/usr/bin/env python3
"""Add llama.cpp's ids for pre-tokenizer types to tests/data/tokenize_pretypes.json: SmolLM2's vocabulary
(tests/data/tokenizer_smollm2.json.gz) written as a vocab-only GGUF with tokenizer.ggml.pre replaced, each case
text (the file's gpt-2 texts) tokenized by llama.cpp's library (add_special and parse_special off) and
detokenized again, as the cases already there were.

    .venv/bin/python scripts/tools/tokenize_pretypes.py gpt-4o [--llama-bin DIR]
"""
from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from ggrun.loaders.synthetic import LlamaConfig, write_gguf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from arch_vs_llama import DEFAULT_ANCHOR, llama_lib  # noqa: E402  (scripts/bench)

DATA = ROOT / "tests" / "data" / "tokenize_pretypes.json"


def vocab_file(path: Path, pre: str) -> Path:
    """SmolLM2's tokenizer under tokenizer.ggml.pre = pre, with a small llama's keys and no tensors."""
    with gzip.open(ROOT / "tests/data/tokenizer_smollm2.json.gz", "rt", encoding="utf-8") as f:
        tok = json.load(f)
    tok["tokenizer.ggml.token_type"] = np.array(tok["tokenizer.ggml.token_type"], np.int32)  # llama.cpp reads int32
    config = LlamaConfig(1, 64, 4, 4, 128, len(tok["tokenizer.ggml.tokens"]), 256)
    return write_gguf(path, "llama", config.metadata() | tok | {"tokenizer.ggml.pre": pre}, {})


def tokenize_all(bin_dir: Path, model: Path, texts: list[str]) -> list[dict]:
    L = llama_lib(bin_dir)
    params = L.llama_model_default_params()
    params.vocab_only = True
    m = L.llama_model_load_from_file(str(model).encode(), params)
    if not m:
        raise SystemExit(f"llama.cpp could not load {model}")
    vocab = L.llama_model_get_vocab(m)
    cases = []
    for text in texts:
        raw = text.encode("utf-8")
        buf = (L.llama_token * (len(raw) + 16))()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
        ids = list(buf[:n])
        out = ctypes.create_string_buffer(4 * len(raw) + 64)
        size = L.llama_detokenize(vocab, buf, n, out, len(out), False, False)
        cases.append({"text": text, "ids": ids, "detokenized": out.raw[:size].decode("utf-8", errors="replace")})
    L.llama_model_free(m)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pre", nargs="+", help="tokenizer.ggml.pre values to add")
    ap.add_argument("--llama-bin", type=Path, default=Path(os.environ.get("LLAMA_BIN", DEFAULT_ANCHOR)))
    args = ap.parse_args()
    data = json.loads(DATA.read_text(encoding="utf-8"))
    texts = [c["text"] for c in data["cases"]["gpt-2"]]
    with tempfile.TemporaryDirectory() as tmp:
        for pre in args.pre:
            data["cases"][pre] = tokenize_all(args.llama_bin, vocab_file(Path(tmp) / f"{pre}.gguf", pre), texts)
    lines = ["{", f'"producer": {json.dumps(data["producer"])},', f'"mode": {json.dumps(data["mode"])},', '"cases": {']
    names = list(data["cases"])
    for i, name in enumerate(names):
        rows = [json.dumps(c, ensure_ascii=False) for c in data["cases"][name]]
        lines.append(f"{json.dumps(name)}: [\n" + ",\n".join(rows) + "\n]" + ("," if i < len(names) - 1 else ""))
    lines += ["}", "}"]
    DATA.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {DATA}")


if __name__ == "__main__":
    main()
