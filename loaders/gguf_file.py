"""Open and validate a GGUF file: header, metadata and tensor directory, with tensor data memory-mapped.

Opening reads only the header; tensor bytes are never touched until a caller asks for one tensor.
Everything wrong with a file becomes one `BadInput` line that names the file, never a traceback.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggrun.core.errors import BadInput, quote_name
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from ggrun.core.quants import SUPPORTED_TYPES, block_layout, dequantize, tensor_nbytes
from ggrun.loaders import gguf_header_cache

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<B",  # read as a byte: anything but 0 or 1 is a corrupt bool, not True
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file and how it is encoded. `shape` is in numpy order (outermost first)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    offset: int  # absolute byte offset in the file


_U64 = struct.Struct("<Q")
_CHUNK = 1 << 20  # bytes of the mapping that `_Cursor.strings` copies out at a time


class _HeaderError(Exception):
    """A problem found while parsing; `open_gguf` prefixes the file name and raises BadInput."""


class _Cursor:
    """Reads little-endian GGUF fields from the mapped file, failing cleanly instead of reading past its end."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def _need(self, n: int, what: str, claim: str | None = None) -> None:
        """Fail unless n more bytes follow. `claim` says what a length field asked for: one larger
        than the whole file may be a corrupt field as well as a cut file, so the message says both."""
        if n < 0 or self.pos + n > len(self.buf):
            if claim is not None and n > len(self.buf):
                raise _HeaderError(f"corrupt or truncated GGUF header: {what} claims {claim}, more than the "
                                   f"whole file ({len(self.buf):,} bytes)")
            raise _HeaderError(f"truncated GGUF header: file ends at byte {len(self.buf)} while reading {what}")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def boolean(self, what: str) -> bool:
        value = self.scalar("<B", what)
        if value > 1:
            raise _HeaderError(f"{what} is a bool stored as byte {value}, expected 0 or 1 (a corrupt value)")
        return bool(value)

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        length = self.u64(what)
        self._need(length, what, f"a length of {length:,} bytes")
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _HeaderError(f"{what} is not valid UTF-8 ({err.reason} at byte {err.start})") from None

    def value(self, vtype: int, what: str) -> Any:
        vtype = _value_type(vtype, what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what)
        if vtype == GGUFValueType.BOOL:
            return self.boolean(what)
        return self.scalar(_SCALAR_FORMATS[vtype], what)

    def array(self, what: str) -> list[Any]:
        etype = _value_type(self.u32(what), what)
        count = self.u64(what)
        if etype in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[etype])
            self._need(count * dtype.itemsize, what, f"{count:,} elements of {dtype.itemsize} bytes")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            if etype == GGUFValueType.BOOL:
                top = int(values.max()) if count else 0
                flags = values.astype(bool).tolist()
                del values  # no view of the mapping may outlive this call, or closing it fails
                if top > 1:
                    raise _HeaderError(f"{what} holds a bool stored as byte {top}, expected 0 or 1")
                return flags
            return values.tolist()
        # Every string or nested array takes at least 8 bytes: this bounds `count` before looping.
        self._need(count * 8, what, f"{count:,} elements of at least 8 bytes")
        if etype == GGUFValueType.STRING:
            return self.strings(count, what)
        return [self.array(what) for _ in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """`count` length-prefixed strings (a vocabulary: ~100k of them), read in a tight loop from bytes
        copied out of the mapping a megabyte at a time (slicing bytes costs much less than slicing the
        mapping: 40 ms less for a 262k-token vocabulary)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length_at = _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            while len(out) < count:
                self._string_fits(pos, len(out), what)
                chunk = buf[pos:pos + max(_CHUNK, 8 + length_at(buf, pos)[0])]
                at, limit = 0, len(chunk)
                try:
                    for _ in range(count - len(out)):  # the strings that lie wholly in this chunk
                        (length,) = length_at(chunk, at)  # struct.error: the chunk ends in this field
                        stop = at + 8 + length
                        if stop > limit:
                            break
                        append(chunk[at + 8:stop].decode("utf-8"))
                        at = stop
                except struct.error:
                    pass
                pos += at
        except UnicodeDecodeError as err:
            raise _HeaderError(f"{what} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
        self.pos = pos
        return out

    def _string_fits(self, pos: int, index: int, what: str) -> None:
        """Fail unless string #index of `what`, at pos, lies within the file."""
        end = len(self.buf)
        if pos + 8 > end:
            raise _HeaderError(f"truncated GGUF header: file ends at byte {end} while reading {what}")
        (length,) = _U64.unpack_from(self.buf, pos)
        if pos + 8 + length > end:
            if length > end:
                raise _HeaderError(f"corrupt or truncated GGUF header: string #{index} of {what} claims "
                                   f"a length of {length:,} bytes, more than the whole file ({end:,} bytes)")
            raise _HeaderError(f"truncated GGUF header: file ends at byte {end} while reading {what}")


def _value_type(code: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(code)
    except ValueError:
        raise _HeaderError(f"unknown metadata value type {code} in {what}") from None


class GGUFFile:
    """An open GGUF file: decoded metadata (and each value's GGUF type), the tensor directory, and
    on-demand access to tensor bytes."""

    def __init__(self, path: Path, version: int, metadata: dict[str, Any], tensors: dict[str, TensorInfo],
                 alignment: int, data_offset: int, mapping: mmap.mmap,
                 types: dict[str, str] | None = None) -> None:
        self.path = path
        self.version = version
        self.metadata = metadata
        self.types = types or {}  # key -> GGUF value type as named in messages: 'UINT32', 'ARRAY[INT32]'
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self._mapping = mapping
        self._bytes = np.frombuffer(mapping, dtype=np.uint8)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"

    @property
    def arch(self) -> str:
        """The model architecture (`general.architecture`), e.g. 'llama'."""
        return self.require("general.architecture")

    @property
    def file_bytes(self) -> int:
        """Total bytes of tensor data (what the weights occupy in their stored formats)."""
        return sum(info.n_bytes for info in self.tensors.values())

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise BadInput(f"{self.path}: missing metadata key {key}")
        return self.metadata[key]

    def require_tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise BadInput(f"{self.path}: missing tensor {name}")
        return self.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes: a read-only uint8 view of the mapped file (no copy, no read yet)."""
        info = self.require_tensor(name)
        if self._bytes is None:
            raise ValueError(f"{self.path} is closed")
        return self._bytes[info.offset:info.offset + info.n_bytes]

    def evict(self, name: str) -> None:
        """Let the OS drop the tensor's pages from this process's memory (they stay in the page
        cache and come back on the next read): for a weight whose bytes were just copied into
        another layout, so the process does not hold both."""
        info = self.require_tensor(name)
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        end = (info.offset + info.n_bytes) // page * page
        if end > start and hasattr(self._mapping, "madvise"):
            self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def load_f32(self, name: str) -> np.ndarray:
        """The tensor decoded to float32 in numpy order; F32 tensors come back as views of the file."""
        info = self.require_tensor(name)
        return dequantize(self.raw(name), info.qtype, info.shape)

    def close(self) -> None:
        """Release the mapping; arrays returned earlier keep the pages alive until they are dropped."""
        self._bytes = None
        try:
            self._mapping.close()
        except BufferError:
            pass  # views handed out by raw()/load_f32() still use it; it closes when they are gone


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file, reading only its header. Raises BadInput naming the file."""
    path = Path(path)
    if not path.exists():
        raise BadInput(f"{path}: no such file")
    if not path.is_file():
        raise BadInput(f"{path}: not a file")
    mapping = _map(path)
    kept = gguf_header_cache.load(path)
    if kept is not None:
        return GGUFFile(path, kept.version, kept.metadata, kept.tensors, kept.alignment, kept.data_offset, mapping,
                        kept.types)
    try:
        gf = _parse(path, mapping)
    except _HeaderError as err:
        _close(mapping)
        raise BadInput(f"{path}: {err}") from None
    except BadInput:
        _close(mapping)
        raise
    except Exception as err:  # any other failure on malformed bytes is still bad input, not a crash
        _close(mapping)
        raise BadInput(f"{path}: corrupt GGUF header ({type(err).__name__}: {quote_name(str(err))})") from None
    gguf_header_cache.save(path, gguf_header_cache.ParsedHeader(gf.version, gf.metadata, gf.types, gf.tensors,
                                                                gf.alignment, gf.data_offset))
    return gf


def _close(mapping: mmap.mmap) -> None:
    """Close a mapping a failed parse leaves; a view still held somewhere keeps it open until dropped."""
    try:
        mapping.close()
    except BufferError:
        pass


def _map(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise BadInput(f"{path}: not a GGUF file (only {size} bytes)")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as err:
        raise BadInput(f"{path}: cannot read ({err.strerror})") from None


def _parse(path: Path, mapping: mmap.mmap) -> GGUFFile:
    cur = _Cursor(mapping)
    version = _read_magic_and_version(cur)
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    metadata, types = _read_metadata(cur, n_kv)
    alignment = _alignment(metadata, types)
    tensors = _read_tensor_infos(cur, n_tensors)
    data_offset = _align(cur.pos, alignment)
    placed = {name: _place(spec, data_offset, alignment, len(mapping)) for name, spec in tensors.items()}
    _check_packed(placed.values(), data_offset, alignment)
    _check_no_trailing_data(placed.values(), len(mapping), alignment)
    return GGUFFile(path, version, metadata, placed, alignment, data_offset, mapping, types)


def _check_no_trailing_data(infos, file_size: int, alignment: int) -> None:
    """The file ends with the last tensor's data and at most its padding, as every GGUF writer (gguf-py,
    llama.cpp) lays it out. A tensor count one too small leaves the last tensor's data, and its directory
    entry read as padding, behind: the other tensors would then be read from the wrong bytes."""
    last = max(infos, key=lambda info: info.offset, default=None)
    if last is None:
        return
    extra = file_size - (last.offset + last.n_bytes)
    if extra >= alignment:
        raise _HeaderError(f"{extra:,} bytes follow the data of the last tensor, {quote_name(last.name)} (a corrupt "
                           "tensor count or directory)")


def _check_packed(infos, data_offset: int, alignment: int) -> None:
    """Tensor data lies packed in directory order, each tensor at the aligned end of the one before, as
    every GGUF writer lays it out and llama.cpp requires: a corrupt type or dimension changes a tensor's
    size and so moves where the next one should start, which is caught here instead of read as garbage."""
    expected, before = 0, None
    for info in infos:
        at = info.offset - data_offset
        if at != expected:
            if before is None:
                raise _HeaderError(f"tensor {quote_name(info.name)}: data offset {at}, expected 0 for the first "
                                   "tensor (a corrupt offset)")
            raise _HeaderError(f"tensor {quote_name(before.name)} ({before.qtype.name} {list(before.shape)}) ends at "
                               f"data offset {expected}, but the next, {quote_name(info.name)}, starts at {at} "
                               "(a corrupt type, dimension or offset)")
        expected, before = expected + _align(info.n_bytes, alignment), info


def _read_magic_and_version(cur: _Cursor) -> int:
    magic = cur.u32("magic")
    if magic != GGUF_MAGIC:
        raise _HeaderError(f"not a GGUF file (bad magic {struct.pack('<I', magic)!r})")
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version >> 16:
        raise _HeaderError("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise _HeaderError(f"unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    return version


def _read_metadata(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The metadata, and each value's GGUF type by name ('ARRAY[T]' for an array of T)."""
    metadata: dict[str, Any] = {}
    types: dict[str, str] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if not key.isprintable():  # key names are text; control bytes mean the reader lost its place
            raise _HeaderError(f"corrupt GGUF header: metadata key #{i} is {quote_name(key)}, not a key name")
        if key in metadata:
            raise _HeaderError(f"duplicate metadata key {quote_name(key)}")
        shown = quote_name(key)
        vtype = cur.u32(f"type of metadata key {shown}")
        etype = cur.scalar("<I", f"element type of {shown}") if vtype == GGUFValueType.ARRAY else None
        if etype is not None:
            cur.pos -= 4  # only peeked: the array reads its element type itself
        metadata[key] = cur.value(vtype, f"metadata value of {shown}")
        types[key] = _type_name(vtype, etype)
    return metadata, types


def _type_name(vtype: int, etype: int | None) -> str:
    name = GGUFValueType(vtype).name
    return name if etype is None else f"{name}[{GGUFValueType(etype).name}]"


def _alignment(metadata: dict[str, Any], types: dict[str, str]) -> int:
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if "general.alignment" in types and types["general.alignment"] != "UINT32":
        raise _HeaderError(f"general.alignment has type {types['general.alignment']}, expected UINT32")
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _HeaderError(f"general.alignment must be a power of two, got {alignment!r}")
    return alignment


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor directory entry as stored: dimensions innermost first, offset relative to the data section."""

    name: str
    type_code: int
    dims: tuple[int, ...]
    rel_offset: int


def _read_tensor_infos(cur: _Cursor, n_tensors: int) -> dict[str, _TensorSpec]:
    specs: dict[str, _TensorSpec] = {}
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        if not name.isprintable():
            raise _HeaderError(f"corrupt GGUF header: the name of tensor #{i} is {quote_name(name)}")
        shown = quote_name(name)
        n_dims = cur.u32(f"dimension count of tensor {shown}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _HeaderError(f"tensor {shown} has {n_dims} dimensions (must be 1..{MAX_DIMS})")
        dims = tuple(cur.u64(f"dimensions of tensor {shown}") for _ in range(n_dims))
        type_code = cur.u32(f"type of tensor {shown}")
        rel_offset = cur.u64(f"offset of tensor {shown}")
        if name in specs:
            raise _HeaderError(f"duplicate tensor {shown}")
        specs[name] = _TensorSpec(name, type_code, dims, rel_offset)
    return specs


def _place(spec: _TensorSpec, data_offset: int, alignment: int, file_size: int) -> TensorInfo:
    """Check one tensor's type, shape and byte range against the file, giving its TensorInfo."""
    qtype = _tensor_type(spec)
    block_size, _ = block_layout(qtype)
    if spec.dims[0] % block_size:
        raise _HeaderError(f"tensor {quote_name(spec.name)}: row length {spec.dims[0]} is not a multiple of the "
                           f"{qtype.name} block size {block_size}")
    n_elements = int(np.prod(spec.dims, dtype=object))
    n_bytes = tensor_nbytes(qtype, n_elements)
    if spec.rel_offset % alignment:
        raise _HeaderError(f"tensor {quote_name(spec.name)}: data offset {spec.rel_offset} is not aligned to {alignment}")
    start = data_offset + spec.rel_offset
    if start + n_bytes > file_size:
        raise _HeaderError(f"tensor {quote_name(spec.name)}: data [{start}, {start + n_bytes}) lies outside the file "
                           f"({file_size} bytes; truncated?)")
    shape = tuple(reversed(spec.dims))
    return TensorInfo(spec.name, qtype, shape, n_elements, n_bytes, start)


def _tensor_type(spec: _TensorSpec) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(spec.type_code)
    except ValueError:
        raise _HeaderError(f"tensor {quote_name(spec.name)} has unknown type id {spec.type_code}") from None
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise _HeaderError(f"tensor {quote_name(spec.name)} has type {qtype.name}, which ggrun does not support "
                           f"(supported: {names})")
    return qtype


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment
