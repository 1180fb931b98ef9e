"""Write a GGUF model's tokenizer metadata (tokenizer.* keys plus general.name/architecture) to a .json.gz fixture.

Usage: python scripts/tools/extract_tokenizer.py MODEL.gguf OUT.json.gz
The fixture loads back with json.load(gzip.open(OUT)) as the metadata dict Tokenizer.from_metadata takes;
it never holds weights (the chat template, when the model has one, is kept).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

_GENERAL_KEYS = ("general.name", "general.architecture")


def read_tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The tokenizer-related metadata of a GGUF file, decoded to plain Python values."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    wanted = [k for k in reader.fields if k.startswith("tokenizer.") or k in _GENERAL_KEYS]
    return {key: _plain(key, reader.fields[key]) for key in wanted}


def _plain(key: str, field: Any) -> Any:
    if key == "tokenizer.ggml.scores":
        # float32 scores written with the shortest text that rounds back to the same float32
        return [float(str(s)) for s in np.asarray(field.contents(), dtype=np.float32)]
    return field.contents()


def write_fixture(md: dict[str, Any], out: Path) -> None:
    text = json.dumps(md, ensure_ascii=False, separators=(",", ":"))
    with gzip.GzipFile(out, "wb", compresslevel=9, mtime=0) as f:
        f.write(text.encode("utf-8"))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    model, out = Path(argv[1]), Path(argv[2])
    md = read_tokenizer_metadata(model)
    write_fixture(md, out)
    print(f"{out}: {len(md.get('tokenizer.ggml.tokens', []))} tokens, {out.stat().st_size / 1e6:.2f} MB",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
