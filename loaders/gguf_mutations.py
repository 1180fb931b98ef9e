"""The GGUF fuzzer's vocabulary: where every field of a GGUF file lies (`read_layout`), and mutations
that each corrupt one thing (`mutate`), grouped in families by what they break. Shared by the property
tests (tests/loaders/test_gguf_fuzz.py) and scripts/tools/fuzz_gguf.py.

Every family but two breaks the file's structure or gives a key the model reads a value no model can
have, so a reader must reject it. The two that may run: flips inside tensor data, undetectable by design
(GGUF has no checksums), and a tensor type changed to another of the same byte size (Q4_0 and Q4_K,
Q5_0 and Q5_K, F16 and BF16 store a row in as many bytes), which reads the same bytes differently just
as undetectably; either may run or stop with non-finite logits. Edits that leave a valid file (renaming
an unread key, changing a vocabulary string, a plausible hyperparameter or the version 3 to 2, whose
layout is the same) are not corruptions any reader could see, and are not made.

For tests and scripts only: it reads bytes with struct alone and never imports the rest of ggrun.
"""
from __future__ import annotations

import math
import mmap
import os
import shutil
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF value types: code -> (struct format or None, size); STRING (8) and ARRAY (9) have no fixed size.
VALUE_FORMATS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
                                 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY, BOOL, UINT32, INT32, FLOAT32 = 8, 9, 7, 4, 5, 6
N_VALUE_TYPES = 13
GGML_TYPE_CODES = (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
                   27, 28, 29, 30, 34, 35, 39)

FAMILIES = ("header", "metadata-type", "metadata-length", "metadata-value", "tensor-dims", "tensor-type",
            "tensor-offset", "tensor-name", "truncation", "tensor-type-same-size", "tensor-data")
MAY_RUN = frozenset({"tensor-type-same-size", "tensor-data"})
MUST_REJECT = frozenset(FAMILIES) - MAY_RUN


@dataclass(frozen=True)
class Field:
    """One fixed-size field: where it lies, its struct format and the value stored there."""

    at: int
    fmt: str
    value: Any

    @property
    def size(self) -> int:
        return struct.calcsize(self.fmt)


@dataclass
class KV:
    """One metadata entry: its key's length field, type code, and the value's fields."""

    key: str
    key_len: Field
    vtype: Field
    value: Field | None = None  # a scalar
    str_len: Field | None = None  # a string value's length
    etype: Field | None = None  # an array's element type
    count: Field | None = None  # an array's element count
    elem_at: np.ndarray | None = None  # arrays: where each element starts (a string element: its length field)


@dataclass
class TensorEntry:
    name: str
    name_len: Field
    n_dims: Field
    dims: list[Field]
    ttype: Field
    offset: Field


@dataclass
class Layout:
    size: int
    magic: Field
    version: Field
    n_tensors: Field
    n_kv: Field
    kvs: list[KV] = field(default_factory=list)
    tensors: list[TensorEntry] = field(default_factory=list)
    data_start: int = 0
    strings: dict[str, str] = field(default_factory=dict)  # the string values, by key

    def kv(self, key: str) -> KV | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    @property
    def arch(self) -> str:
        return self.strings.get("general.architecture", "")

    @property
    def n_vocab(self) -> int:
        kv = self.kv("tokenizer.ggml.tokens")
        return 0 if kv is None or kv.count is None else kv.count.value


class _Reader:
    def __init__(self, buf) -> None:
        self.buf = buf
        self.pos = 0

    def field(self, fmt: str) -> Field:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        f = Field(self.pos, fmt, value)
        self.pos += struct.calcsize(fmt)
        return f

    def string(self) -> tuple[Field, str]:
        length = self.field("<Q")
        text = bytes(self.buf[self.pos:self.pos + length.value]).decode("utf-8", "replace")
        self.pos += length.value
        return length, text


def read_layout(path: str | os.PathLike[str]) -> Layout:
    """The layout of a valid GGUF file (version 3, little-endian)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _Reader(buf)
        lay = Layout(len(buf), r.field("<I"), r.field("<I"), r.field("<Q"), r.field("<Q"))
        for _ in range(lay.n_kv.value):
            key_len, key = r.string()
            kv = KV(key, key_len, r.field("<I"))
            _read_value(r, kv)
            lay.kvs.append(kv)
        for _ in range(lay.n_tensors.value):
            name_len, name = r.string()
            n_dims = r.field("<I")
            dims = [r.field("<Q") for _ in range(n_dims.value)]
            lay.tensors.append(TensorEntry(name, name_len, n_dims, dims, r.field("<I"), r.field("<Q")))
        align_kv = lay.kv("general.alignment")
        alignment = align_kv.value.value if align_kv is not None else 32
        lay.data_start = -(-r.pos // alignment) * alignment
        lay.strings = {kv.key: _decode_string(buf, kv) for kv in lay.kvs if kv.str_len is not None}
    return lay


def _decode_string(buf, kv: KV) -> str:
    start = kv.str_len.at + 8
    return bytes(buf[start:start + kv.str_len.value]).decode("utf-8", "replace")


def _read_value(r: _Reader, kv: KV) -> None:
    code = kv.vtype.value
    if code == STRING:
        kv.str_len, _ = r.string()
    elif code == ARRAY:
        kv.etype = r.field("<I")
        kv.count = r.field("<Q")
        n, et = kv.count.value, kv.etype.value
        if et == STRING:
            at = np.empty(n, dtype=np.int64)
            for i in range(n):
                at[i] = r.pos
                (length,) = struct.unpack_from("<Q", r.buf, r.pos)
                r.pos += 8 + length
            kv.elem_at = at
        else:
            size = struct.calcsize(VALUE_FORMATS[et])
            kv.elem_at = r.pos + size * np.arange(n, dtype=np.int64)
            r.pos += size * n
    else:
        kv.value = r.field(VALUE_FORMATS[code])


# ---- mutations ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """One corruption: byte patches at offsets, or a truncation; `family` says what kind it is."""

    family: str
    target: str
    patches: tuple[tuple[int, bytes], ...] = ()
    truncate: int | None = None

    def apply_bytes(self, data: bytes) -> bytes:
        out = bytearray(data if self.truncate is None else data[:self.truncate])
        for at, raw in self.patches:
            out[at:at + len(raw)] = raw
        return bytes(out)

    def apply_file(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        """dst = src with this mutation (a copy; the patches touch a few bytes of it)."""
        if self.truncate is not None:
            with open(src, "rb") as fin, open(dst, "wb") as fout:
                shutil.copyfileobj(_limited(fin, self.truncate), fout)
        else:
            shutil.copyfile(src, dst)
        if self.patches:
            with open(dst, "r+b") as f:
                for at, raw in self.patches:
                    f.seek(at)
                    f.write(raw)


class _limited:
    def __init__(self, f, n: int) -> None:
        self.f, self.left = f, n

    def read(self, size: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        data = self.f.read(self.left if size < 0 else min(size, self.left))
        self.left -= len(data)
        return data


def _set(f: Field, value: Any, family: str, target: str) -> Mutation:
    return Mutation(family, f"{target} {f.value!r} -> {value!r}", ((f.at, _pack(f.fmt, value)),))


_UNSIGNED = {"b": "B", "h": "H", "i": "I", "q": "Q"}


def _pack(fmt: str, value: Any) -> bytes:
    """value in a field of format fmt; an integer wraps to the field's width (-1 -> all ones)."""
    if fmt[-1] in "fd":
        return struct.pack(fmt, value)
    return struct.pack("<" + _UNSIGNED.get(fmt[-1], fmt[-1]), int(value) % (1 << 8 * struct.calcsize(fmt)))


def _u64_values(v: int, rng: np.random.Generator) -> list[int]:
    """Wrong values for a length, count or dimension that was v."""
    values = {0, 1, v + 1, v + 7, 2 * v + 1, 2**31, 2**32 + v, 2**63, 2**64 - 1, int(rng.integers(0, 2**63)),
              int(rng.integers(2, 4096))}
    if v > 1:
        values |= {v - 1, v // 2}
    values.discard(v)
    return sorted(values)


def _u32_codes(v: int, n_codes: int, rng: np.random.Generator) -> list[int]:
    values = set(range(n_codes)) | {n_codes, 100, 2**31, 2**32 - 1, int(rng.integers(0, 2**32))}
    values.discard(v)
    return sorted(values)


def _pick(rng: np.random.Generator, items: list):
    return items[int(rng.integers(len(items)))]


def mutate(lay: Layout, rng: np.random.Generator, family: str | None = None) -> Mutation:
    """One random mutation of the file `lay` describes, of `family` (or any family)."""
    family = family or _pick(rng, list(FAMILIES))
    return _MAKERS[family](lay, rng)


def _header(lay: Layout, rng) -> Mutation:
    which = _pick(rng, ["magic", "version", "n_tensors", "n_kv"])
    f = getattr(lay, which)
    if which == "magic":
        i = int(rng.integers(4))
        raw = bytearray(struct.pack("<I", f.value))
        raw[i] ^= 1 << int(rng.integers(8))
        return Mutation("header", f"magic byte {i} flipped", ((f.at, bytes(raw)),))
    if which == "version":  # never 2 or 3: both have the same layout, so either is a valid file
        values = [0, 1, 4, 5, 2**16 + 3, 2**31, int(rng.integers(4, 2**32))]
        return _set(f, _pick(rng, values), "header", "version")
    return _set(f, _pick(rng, _u64_values(f.value, rng)), "header", which)


def _metadata_type(lay: Layout, rng) -> Mutation:
    kvs = [kv for kv in lay.kvs if kv.etype is not None]
    if kvs and rng.random() < 0.3:
        kv = _pick(rng, kvs)
        return _set(kv.etype, _pick(rng, _u32_codes(kv.etype.value, N_VALUE_TYPES, rng)), "metadata-type",
                    f"element type of {kv.key}")
    kv = _pick(rng, lay.kvs)
    return _set(kv.vtype, _pick(rng, _u32_codes(kv.vtype.value, N_VALUE_TYPES, rng)), "metadata-type",
                f"type of {kv.key}")


def _metadata_length(lay: Layout, rng) -> Mutation:
    kv = _pick(rng, lay.kvs)
    options = [("key length of", kv.key_len)]
    if kv.str_len is not None:
        options.append(("length of", kv.str_len))
    if kv.count is not None:
        options.append(("element count of", kv.count))
        if kv.etype.value == STRING and len(kv.elem_at):
            i = int(rng.integers(len(kv.elem_at)))
            at = int(kv.elem_at[i])
            options.append((f"length of string #{i} of", Field(at, "<Q", _u64_at(lay, kv, i))))
    what, f = _pick(rng, options)
    return _set(f, _pick(rng, _u64_values(f.value, rng)), "metadata-length", f"{what} {kv.key}")


def _u64_at(lay: Layout, kv: KV, i: int) -> int:
    """The length of string element i of kv (the next element starts 8 + length bytes later)."""
    at = kv.elem_at
    end = int(at[i + 1]) if i + 1 < len(at) else None
    if end is not None:
        return end - int(at[i]) - 8
    nxt = [k.key_len.at for k in lay.kvs if k.key_len.at > at[i]] + [t.name_len.at for t in lay.tensors]
    return min(x for x in nxt if x > at[i]) - int(at[i]) - 8


# Keys a llama-family model reads, by kind; the values below are wrong for every model.
_COUNT_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.key_length", "attention.value_length",
               "rope.dimension_count", "vocab_size")
_FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")
_BOOL_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
              "tokenizer.ggml.add_sep_token")
_NAME_KEYS = ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre")  # pre: BPE (gpt2) only


def _metadata_value(lay: Layout, rng) -> Mutation:
    arch = lay.arch
    n_vocab = lay.n_vocab
    names = _NAME_KEYS if lay.strings.get("tokenizer.ggml.model") == "gpt2" else _NAME_KEYS[:2]
    choices: list[tuple[Field, list, str]] = []
    for kv in lay.kvs:
        short = kv.key[len(arch) + 1:] if kv.key.startswith(arch + ".") else None
        if kv.value is not None and short in _COUNT_KEYS:
            choices.append((kv.value, [0, 2**31, 2**32 - 1], kv.key))
        elif kv.value is not None and short == "attention.sliding_window":
            choices.append((kv.value, [2**31, 2**32 - 1], kv.key))
        elif kv.value is not None and short in _FLOAT_KEYS:
            choices.append((kv.value, [math.nan, math.inf, -math.inf, 0.0, -1.0], kv.key))
        elif kv.value is not None and kv.key.endswith("_token_id") and kv.key.startswith("tokenizer.ggml."):
            choices.append((kv.value, [n_vocab, n_vocab + 1000, 2**31], kv.key))
        elif kv.value is not None and kv.key in _BOOL_KEYS:
            choices.append((kv.value, [2, 255], kv.key))
        elif kv.str_len is not None and kv.key in names and kv.str_len.value:
            garbage = "".join(chr(int(c)) for c in rng.integers(ord("a"), ord("z") + 1, kv.str_len.value))
            choices.append((Field(kv.str_len.at + 8, f"{kv.str_len.value}s", b""), [garbage.encode()], kv.key))
        elif kv.key == "tokenizer.ggml.token_type" and kv.etype.value == INT32:
            i = int(rng.integers(len(kv.elem_at)))
            choices.append((Field(int(kv.elem_at[i]), "<i", None), [99, -1, 2**31 - 1], f"{kv.key}[{i}]"))
        elif kv.key == "tokenizer.ggml.scores" and kv.etype.value == FLOAT32:
            i = int(rng.integers(len(kv.elem_at)))
            choices.append((Field(int(kv.elem_at[i]), "<f", None), [math.nan, math.inf, -math.inf], f"{kv.key}[{i}]"))
    f, values, target = _pick(rng, choices)
    value = _pick(rng, values)
    if f.fmt.endswith("s"):
        return Mutation("metadata-value", f"{target} -> {value.decode()!r}", ((f.at, value),))
    return _set(f, value, "metadata-value", target)


def _tensor(lay: Layout, rng) -> TensorEntry:
    return _pick(rng, lay.tensors)


def _tensor_dims(lay: Layout, rng) -> Mutation:
    t = _tensor(lay, rng)
    if rng.random() < 0.2:
        return _set(t.n_dims, _pick(rng, sorted({0, t.n_dims.value - 1, t.n_dims.value + 1, 5, 2**31} - {t.n_dims.value})),
                    "tensor-dims", f"dimension count of {t.name}")
    i = int(rng.integers(len(t.dims)))
    return _set(t.dims[i], _pick(rng, _u64_values(t.dims[i].value, rng)), "tensor-dims", f"dimension {i} of {t.name}")


def _nbytes(code: int, dims: list[Field]) -> int | None:
    """Bytes of a tensor of type `code` and these dimensions; None for an unknown type or rows that
    are not whole blocks."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(code)]
    except (ValueError, KeyError):
        return None
    if dims[0].value % block:
        return None
    return int(np.prod([d.value for d in dims], dtype=object)) // block * size


def _tensor_type(lay: Layout, rng) -> Mutation:
    """A type whose tensor would take a different number of bytes (or none: an unknown or ill-fitting one)."""
    t = _tensor(lay, rng)
    same = _nbytes(t.ttype.value, t.dims)
    codes = [c for c in sorted(set(GGML_TYPE_CODES) | {4, 5, 31, 100, 2**31, int(rng.integers(0, 2**32))})
             if c != t.ttype.value and _nbytes(c, t.dims) != same]
    return _set(t.ttype, _pick(rng, codes), "tensor-type", f"type of {t.name}")


def _tensor_type_same_size(lay: Layout, rng) -> Mutation:
    """A type that stores the tensor in exactly as many bytes (the reader cannot tell; data reads differently)."""
    options = [(t, c) for t in lay.tensors for c in GGML_TYPE_CODES
               if c != t.ttype.value and _nbytes(c, t.dims) == _nbytes(t.ttype.value, t.dims)]
    t, code = _pick(rng, options)
    return _set(t.ttype, code, "tensor-type-same-size",
                f"type of {t.name} ({GGMLQuantizationType(t.ttype.value).name} -> {GGMLQuantizationType(code).name})")


def _tensor_offset(lay: Layout, rng) -> Mutation:
    t = _tensor(lay, rng)
    v = t.offset.value
    values = {v + 1, v + 32, v + 64, v + 2**32, 2**64 - 1, lay.size, int(rng.integers(0, lay.size))}
    if v:
        values |= {0, v - 1, v - 32}
    values.discard(v)
    return _set(t.offset, _pick(rng, sorted(values)), "tensor-offset", f"offset of {t.name}")


def _tensor_name(lay: Layout, rng) -> Mutation:
    t = _tensor(lay, rng)
    return _set(t.name_len, _pick(rng, _u64_values(t.name_len.value, rng)), "tensor-name", f"name length of {t.name}")


def _truncation(lay: Layout, rng) -> Mutation:
    if rng.random() < 0.5:
        at = int(rng.integers(0, lay.data_start))
        return Mutation("truncation", f"cut at byte {at} (in the header)", truncate=at)
    at = int(rng.integers(lay.data_start, lay.size))
    return Mutation("truncation", f"cut at byte {at} (in tensor data)", truncate=at)


def _tensor_data(lay: Layout, rng) -> Mutation:
    n = int(rng.integers(1, 9))
    at = rng.integers(lay.data_start, lay.size, n)
    patches = tuple((int(a), bytes([int(rng.integers(256))])) for a in at)
    return Mutation("tensor-data", f"{n} byte(s) in tensor data rewritten", patches)


_MAKERS = {"header": _header, "metadata-type": _metadata_type, "metadata-length": _metadata_length,
           "metadata-value": _metadata_value, "tensor-dims": _tensor_dims, "tensor-type": _tensor_type,
           "tensor-offset": _tensor_offset, "tensor-name": _tensor_name, "truncation": _truncation,
           "tensor-type-same-size": _tensor_type_same_size, "tensor-data": _tensor_data}
assert set(_MAKERS) == set(FAMILIES)


def variants(path: str | os.PathLike[str], n: int, seed: int, families: tuple[str, ...] = FAMILIES,
             ) -> list[Mutation]:
    """n mutations of the file at path, reproducible from the seed, families taken in turn."""
    lay = read_layout(path)
    rng = np.random.default_rng(seed)
    return [mutate(lay, rng, families[i % len(families)]) for i in range(n)]
