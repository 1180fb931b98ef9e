"""The parsed header of a large GGUF file (version, metadata and its value types, tensor directory, data
offset) kept on disk, so that a later open of the same file unpickles it instead of reading the metadata
value by value: SmolLM2's 98k vocabulary strings take 45 ms to read and 15 ms to unpickle, gemma-3-270m's
262k 125 ms and 50 ms.

Kept like the repacked weights (core/cache.py): one file per model path, holding the model file's
identity (path, size, modification time, inode) and a digest of the reader's code; any difference means
the header is parsed (and checked) again. Files under MIN_BYTES parse in milliseconds and are not kept.
Only what ggrun's own reader wrote into ggrun's own cache directory is ever unpickled.
"""
from __future__ import annotations

import copyreg
import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ggrun.core.cache import derived_path, file_identity, write_atomically
from gguf.constants import GGMLQuantizationType

MIN_BYTES = 16 << 20


@dataclass(frozen=True)
class ParsedHeader:
    """What gguf_file's parser makes of a header (GGUFFile's fields but the mapping)."""

    version: int
    metadata: dict[str, Any]
    types: dict[str, str]
    tensors: dict[str, Any]
    alignment: int
    data_offset: int


def _reader_digest() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for source in (here / "gguf_file.py", here.parent / "core" / "quants.py"):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _key(path: str | os.PathLike[str]) -> dict | None:
    identity = file_identity(path)
    if identity is None or identity["size"] < MIN_BYTES:
        return None
    return {**identity, "reader": _reader_digest()}


def load(path: str | os.PathLike[str]) -> ParsedHeader | None:
    """The header an earlier open of this very file parsed, or None."""
    key = _key(path)
    if key is None:
        return None
    try:
        with open(derived_path("headers", key, ".pickle"), "rb") as f:
            kept_key, header = pickle.load(f)
    except Exception:  # absent, unreadable or damaged: parse
        return None
    return header if kept_key == key and isinstance(header, ParsedHeader) else None


def save(path: str | os.PathLike[str], header: ParsedHeader) -> None:
    """Keep the header just parsed from the file at `path` (a small file's, or a failing write, is not)."""
    key = _key(path)
    if key is None:
        return
    def write(f) -> None:
        pickler = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
        # a type is kept as its number: unpickling gguf's enum by name would import all of gguf's package
        pickler.dispatch_table = {**copyreg.dispatch_table, GGMLQuantizationType: _reduce_quant_type}
        pickler.dump((key, header))

    try:
        write_atomically(derived_path("headers", key, ".pickle"), write)
    except OSError:
        pass


def _reduce_quant_type(qtype: GGMLQuantizationType):
    return _quant_type, (int(qtype),)


def _quant_type(code: int) -> GGMLQuantizationType:
    return GGMLQuantizationType(code)
