"""Repacked weights kept on disk between runs: the first load of a model repacks its matrices for the
decode kernels (matmul.repack: about 0.3 s for SmolLM2's 92 MB) and writes the result to one file under
ggrun's cache; later loads map that file instead, so they neither spend the time nor read the stored
blocks those matrices came from (the mapped pages come in as the kernels first read them, as llama.cpp's
weights do).

The file belongs to one model path. Its header names the model file (size, modification time, inode)
and the repack code (a digest of its sources and the host's kernel layout) it was made from; any
difference makes it stale, and the load repacks and rewrites it. Writing is atomic (a temporary file
renamed); a cache that cannot be read or written costs only the repack, never a failure. What is mapped
is byte for byte what repack made.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from ggrun.core.backends.cpu.quant import codes, layouts
from ggrun.core.cache import derived_path, file_identity, write_atomically

MAGIC = b"GGRUNRP1"
ALIGN = 4096  # each array starts on a page of its own
MIN_BYTES = 16 << 20  # a smaller model repacks in milliseconds: not worth a file
_HEAD = struct.Struct("<8sQ")  # magic, header length

Packed = np.ndarray | layouts.RI64  # what matmul.repack returns


def layout_digest() -> str:
    """What the repacked bytes depend on besides the model: the repack code and the level's layout."""
    digest = hashlib.sha256(codes.SIMD.encode())
    for name in ("quant/codes.py", "quant/layouts.py", "matmul.py"):
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


class RepackCache:
    """The repacked weights of one model file: those found on disk (`get`) and those made by this
    load (`put`), written together by `save` when anything was made."""

    def __init__(self, path: Path, key: dict) -> None:
        self.path = path
        self.key = key
        self._found: dict[str, Packed] = _read(path, key)
        self._made: dict[str, Packed] = {}

    @classmethod
    def for_model(cls, model: str | os.PathLike[str]) -> RepackCache | None:
        """The cache of the model file at `model` (None when the file cannot be looked at)."""
        identity = file_identity(model)
        if identity is None:
            return None
        return cls(derived_path("repacked", identity, ".bin"), {**identity, "layout": layout_digest()})

    def get(self, name: str) -> Packed | None:
        """Weight `name` as repacked by an earlier load of this model file, or None."""
        return self._found.get(name)

    def put(self, name: str, packed: Packed) -> None:
        """Weight `name` as this load repacked it, to be written by `save`."""
        self._made[name] = packed

    def save(self) -> None:
        """Write every repacked weight of the model (found and made) when this load made any, so the
        next load finds them all; a model under MIN_BYTES, or a failing write, leaves no file."""
        if not self._made:
            return
        weights = {**self._found, **self._made}
        if sum(a.nbytes for p in weights.values() for a in _arrays(p)) < MIN_BYTES:
            return
        try:
            _write(self.path, self.key, weights)
        except OSError:
            pass


def _arrays(packed: Packed) -> tuple[np.ndarray, ...]:
    return tuple(packed) if isinstance(packed, tuple) else (packed,)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _write(path: Path, key: dict, weights: dict[str, Packed]) -> None:
    """Header (key, and per weight its kind and arrays: offset, shape, dtype), then the arrays."""
    entries, placed = {}, []
    at = 0
    for name, packed in weights.items():
        spec = []
        for a in _arrays(packed):
            spec.append([at, list(a.shape), a.dtype.str])
            placed.append((at, np.ascontiguousarray(a)))
            at = _align(at + a.nbytes)
        entries[name] = {"ri64": isinstance(packed, layouts.RI64), "arrays": spec}
    header = json.dumps({"key": key, "weights": entries, "data_bytes": at}).encode()
    start = _align(_HEAD.size + len(header))

    def write(f) -> None:
        f.write(_HEAD.pack(MAGIC, len(header)) + header)
        for offset, a in placed:
            f.seek(start + offset)
            f.write(a.data)
        f.truncate(start + at)

    write_atomically(path, write)


def _read(path: Path, key: dict) -> dict[str, Packed]:
    """The weights of a cache file made from exactly `key`, as arrays over a private (copy-on-write)
    mapping of it: writable like the arrays repack makes, which numba compiles the kernels for (it
    treats read-only arrays as a type of their own). Empty when the file is absent, stale or damaged."""
    try:
        with open(path, "rb") as f:
            magic, length = _HEAD.unpack(f.read(_HEAD.size))
            if magic != MAGIC:
                return {}
            header = json.loads(f.read(length))
            if header.get("key") != key:
                return {}
            start = _align(_HEAD.size + length)
            if os.fstat(f.fileno()).st_size != start + header["data_bytes"]:
                return {}
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError, KeyError, struct.error):
        return {}
    data = np.frombuffer(mapping, dtype=np.uint8, offset=start)
    found = {}
    for name, entry in header["weights"].items():
        arrays = []
        for offset, shape, dtype in entry["arrays"]:
            dt = np.dtype(dtype)
            arrays.append(data[offset:offset + dt.itemsize * int(np.prod(shape))].view(dt).reshape(shape))
        found[name] = layouts.RI64(*arrays) if entry["ri64"] else arrays[0]
    return found
