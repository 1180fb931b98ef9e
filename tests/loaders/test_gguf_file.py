"""open_gguf: every kind of bad file gives one BadInput line naming it; good files round-trip."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize
from hypothesis import given, settings, strategies as st

from ggrun.core.errors import BadInput
from ggrun.loaders.gguf_file import GGUFFile, TensorInfo, open_gguf
from ggrun.loaders.synthetic import QuantizedTensor, write_gguf, write_tiny_llama

METADATA = {
    "general.name": "round trip",
    "test.u32": 7,
    "test.i32": -7,
    "test.u8": np.uint8(255),
    "test.i64": np.int64(-(2 ** 40)),
    "test.u64": np.uint64(2 ** 63),
    "test.f32": 0.5,
    "test.f64": np.float64(1 / 3),
    "test.bool": True,
    "test.empty_string": "",
    "test.unicode": "héllo ✓",
    "test.strings": ["a", "", "Ġthe"],
    "test.ints": np.array([3, -1, 2], dtype=np.int32),
    "test.floats": np.array([0.25, -1.5], dtype=np.float32),
}


@pytest.fixture
def good_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    values = {
        "a.f32": rng.standard_normal((3, 5)).astype(np.float32),
        "b.f16": rng.standard_normal((2, 4, 8)).astype(np.float16),
        "c.q8": rng.standard_normal((4, 64)).astype(np.float32),
        "d.vec": rng.standard_normal(7).astype(np.float32),
    }
    tensors = dict(values) | {"c.q8": QuantizedTensor(quantize(values["c.q8"], QT.Q8_0), QT.Q8_0)}
    return write_gguf(tmp_path / "good.gguf", "test", METADATA, tensors), values


def _bad(path: Path, match: str) -> str:
    with pytest.raises(BadInput, match=match) as info:
        open_gguf(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def test_metadata_round_trips(good_file):
    path, _ = good_file
    with open_gguf(path) as f:
        assert f.arch == "test"
        assert f.version == 3
        for key, value in METADATA.items():
            expected = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
            assert f.metadata[key] == expected, key
            assert type(f.metadata[key]) is type(expected), key
        assert f.get("missing", 42) == 42
        assert f.require("test.u32") == 7


def test_tensors_round_trip(good_file):
    path, values = good_file
    with open_gguf(path) as f:
        assert set(f.tensors) == set(values)
        for name, expected in values.items():
            info = f.tensors[name]
            assert info.shape == expected.shape
            assert info.n_elements == expected.size
            assert f.raw(name).nbytes == info.n_bytes
            loaded = f.load_f32(name)
            assert loaded.dtype == np.float32 and loaded.shape == expected.shape
            tolerance = 0.02 if name == "c.q8" else 0
            np.testing.assert_allclose(loaded, expected.astype(np.float32), atol=tolerance * np.abs(expected).max())
        assert f.tensors["c.q8"].qtype == QT.Q8_0 and f.tensors["c.q8"].n_bytes == 4 * 2 * 34
        assert f.file_bytes == sum(info.n_bytes for info in f.tensors.values())


def test_tensor_info_matches_file_bytes(good_file):
    path, values = good_file
    data = path.read_bytes()
    with open_gguf(path) as f:
        info = f.tensors["a.f32"]
        assert isinstance(info, TensorInfo)
        assert data[info.offset:info.offset + info.n_bytes] == values["a.f32"].tobytes()
        assert info.offset % f.alignment == 0


def test_f32_loads_without_copy(good_file):
    path, _ = good_file
    with open_gguf(path) as f:
        assert np.shares_memory(f.load_f32("a.f32"), f.raw("a.f32"))
        assert not f.load_f32("a.f32").flags.writeable


def test_missing_key_and_tensor(good_file):
    path, _ = good_file
    with open_gguf(path) as f:
        with pytest.raises(BadInput, match=f"^{path}: missing metadata key llama.block_count$"):
            f.require("llama.block_count")
        with pytest.raises(BadInput, match=f"^{path}: missing tensor output.weight$"):
            f.require_tensor("output.weight")


def test_close_keeps_earlier_arrays_valid(good_file):
    path, values = good_file
    f = open_gguf(path)
    a = f.load_f32("a.f32")
    f.close()
    np.testing.assert_array_equal(a, values["a.f32"])
    with pytest.raises(ValueError, match="closed"):
        f.raw("a.f32")


def test_missing_file(tmp_path):
    _bad(tmp_path / "nope.gguf", "no such file")


def test_directory(tmp_path):
    _bad(tmp_path, "not a file")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _bad(path, "not a GGUF file")


def test_bad_magic(tmp_path):
    path = tmp_path / "text.gguf"
    path.write_text("hello, this is not a model\n")
    _bad(path, r"not a GGUF file \(bad magic b'hell'\)")


@pytest.mark.parametrize("version", [1, 4, 99])
def test_unsupported_version(good_file, tmp_path, version):
    path = _patched(good_file[0], tmp_path, 4, struct.pack("<I", version))
    _bad(path, f"unsupported GGUF version {version}")


def test_big_endian(good_file, tmp_path):
    _bad(_patched(good_file[0], tmp_path, 4, struct.pack(">I", 3)), "big-endian")


def test_truncated_header(good_file, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(good_file[0].read_bytes()[:100])
    _bad(path, "truncated GGUF header")


def test_truncated_tensor_data(tmp_path):
    data = write_tiny_llama(tmp_path / "tiny.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 1000])
    message = _bad(path, "lies outside the file")
    assert "output.weight" in message


def test_unsupported_tensor_type(tmp_path):
    path = write_gguf(tmp_path / "ints.gguf", "test", {}, {"ids": np.arange(8, dtype=np.int32)})
    _bad(path, "tensor ids has type I32, which ggrun does not support")


def test_unknown_tensor_type(good_file, tmp_path):
    path, _ = good_file
    data = path.read_bytes()
    at = _tensor_type_field(data, b"d.vec", n_dims=1)
    _bad(_patched(path, tmp_path, at, struct.pack("<I", 250)), "tensor d.vec has unknown type id 250")


def test_unknown_value_type(good_file, tmp_path):
    path, _ = good_file
    data = path.read_bytes()
    key = b"general.name"
    at = data.index(key) + len(key)
    _bad(_patched(path, tmp_path, at, struct.pack("<I", 77)), "unknown metadata value type 77")


def test_huge_counts_are_truncation_not_memory_errors(good_file, tmp_path):
    path = _patched(good_file[0], tmp_path, 16, struct.pack("<Q", 2 ** 62))
    _bad(path, "truncated GGUF header")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_corrupt_headers_never_crash(tmp_path_factory, data):
    src = _fuzz_source(tmp_path_factory)
    blob = bytearray(src.read_bytes())
    with open_gguf(src) as good:
        header_end = good.data_offset - 1
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(8, header_end))
        blob[pos] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "corrupt.gguf"
    path.write_bytes(bytes(blob))
    try:
        open_gguf(path).close()
    except BadInput as err:
        assert str(err).startswith(f"{path}: ") and "\n" not in str(err)


def test_opening_reads_no_tensor_data(tmp_path, monkeypatch):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    touched: list[str] = []
    monkeypatch.setattr("ggrun.loaders.gguf_file.dequantize", lambda *a: touched.append("dequantize"))
    f = open_gguf(path)
    assert isinstance(f, GGUFFile) and not touched
    f.close()


def _patched(src: Path, tmp_path: Path, at: int, new: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[at:at + len(new)] = new
    path = tmp_path / f"patched_{at}.gguf"
    path.write_bytes(bytes(data))
    return path


def _tensor_type_field(data: bytes, name: bytes, n_dims: int) -> int:
    """Byte offset of a tensor's type field in the directory: after its name, n_dims and dims."""
    return data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 8 * n_dims


_FUZZ_SOURCE: list[Path] = []


def _fuzz_source(tmp_path_factory) -> Path:
    if not _FUZZ_SOURCE:
        _FUZZ_SOURCE.append(write_tiny_llama(tmp_path_factory.mktemp("fuzzsrc") / "tiny.gguf", n_layer=1))
    return _FUZZ_SOURCE[0]


def test_retyped_or_resized_tensor_breaks_the_packed_layout(tmp_path):
    """Tensor data lies packed in directory order (as llama.cpp requires), so a corrupt type or dimension,
    which changes a tensor's size, is caught at the next tensor's offset."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layer=1)
    data = path.read_bytes()
    at = _tensor_type_field(data, b"blk.0.attn_norm.weight", 1)
    message = _bad(_patched(path, tmp_path, at, struct.pack("<I", int(QT.F16))),
                   r"tensor blk\.0\.attn_norm\.weight \(F16 \[64\]\) ends at data offset \d+, but the next, \S+, "
                   r"starts at \d+ \(a corrupt type, dimension or offset\)$")
    assert len(message) < 300
    _bad(_patched(path, tmp_path, at - 8, struct.pack("<Q", 1)), r"tensor blk\.0\.attn_norm\.weight \(F32 \[1\]\) ends")
    first = _tensor_type_field(data, b"token_embd.weight", 2)
    _bad(_patched(path, tmp_path, first + 4, struct.pack("<Q", 32)),
         r"tensor token_embd\.weight: data offset 32, expected 0 for the first tensor")


def test_bool_bytes_other_than_0_or_1_are_corrupt(tmp_path):
    """A bool is one byte, 0 or 1; struct's '?' would read 255 as True and hide the corruption."""
    path = write_gguf(tmp_path / "b.gguf", "llama", {"test.flag": True, "test.flags": [True, False]}, {})
    data = path.read_bytes()
    flag = data.index(b"test.flag") + len(b"test.flag") + 4  # past the key and its type code
    _bad(_patched(path, tmp_path, flag, b"\xff"), r"metadata value of test\.flag is a bool stored as byte 255, "
                                                  r"expected 0 or 1")
    flags = data.index(b"test.flags") + len(b"test.flags") + 4 + 4 + 8  # past the type, element type, count
    _bad(_patched(path, tmp_path, flags + 1, b"\x02"), r"test\.flags holds a bool stored as byte 2")


def test_value_types_are_recorded(good_file, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", METADATA, {})
    with open_gguf(path) as f:
        assert f.types["test.u32"] == "UINT32" and f.types["test.i32"] == "INT32" and f.types["test.bool"] == "BOOL"
        assert f.types["test.strings"] == "ARRAY[STRING]" and f.types["test.ints"] == "ARRAY[INT32]"
        assert f.types["general.architecture"] == "STRING"


def test_alignment_must_be_uint32(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", "llama", {"general.alignment": np.int32(32)}, {})
    _bad(path, "general.alignment has type INT32, expected UINT32")


def test_a_tensor_count_one_too_small_is_caught_by_the_data_left_over(tmp_path):
    """With the count one short, the last directory entry is read as padding and every tensor from bytes
    before its own; only the bytes left after the (now) last tensor's data give it away."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layer=1)
    n = struct.unpack_from("<Q", path.read_bytes(), 8)[0]
    _bad(_patched(path, tmp_path, 8, struct.pack("<Q", n - 1)), r"bytes follow the data of the last tensor, "
                                                                 r"\S+ \(a corrupt tensor count or directory\)")
    padded = tmp_path / "padded.gguf"
    padded.write_bytes(path.read_bytes() + b"\0" * 31)  # less than the alignment: an unpadded writer's slack
    open_gguf(padded).close()
    padded.write_bytes(path.read_bytes() + b"\0" * 32)
    _bad(padded, "32 bytes follow the data of the last tensor")
