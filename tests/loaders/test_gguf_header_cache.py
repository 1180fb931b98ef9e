"""A large GGUF file's parsed header kept on disk (loaders/gguf_header_cache.py): a second open gets the
same header without parsing; a changed model file or a damaged cache file is parsed again; a small file
leaves nothing."""
from __future__ import annotations

import os

import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.loaders import gguf_file, gguf_header_cache
from ggrun.loaders.gguf_file import open_gguf
from ggrun.loaders.synthetic import write_tiny_llama


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """An empty ggrun cache that keeps even a tiny model's header; the folder headers go to."""
    monkeypatch.setenv("GGRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_header_cache, "MIN_BYTES", 0)
    return tmp_path / "cache" / "headers"


@pytest.fixture
def model(tmp_path):
    return write_tiny_llama(tmp_path / "m.gguf", weight_type=QT.Q8_0)


def no_parsing(monkeypatch):
    def refuse(*args):
        raise AssertionError("parsed")

    monkeypatch.setattr(gguf_file, "_parse", refuse)


def same(a, b) -> bool:
    return (a.version, a.metadata, a.types, a.tensors, a.alignment, a.data_offset) == \
        (b.version, b.metadata, b.types, b.tensors, b.alignment, b.data_offset)


def test_second_open_is_not_parsed(kept, model, monkeypatch):
    first = open_gguf(model)
    assert len(list(kept.iterdir())) == 1
    no_parsing(monkeypatch)
    second = open_gguf(model)
    assert same(first, second)
    assert bytes(second.raw("token_embd.weight")[:64]) == bytes(first.raw("token_embd.weight")[:64])


def test_changed_model_or_damaged_header_is_parsed_again(kept, model):
    open_gguf(model)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_header_cache.load(model) is None
    open_gguf(model)  # parsed and kept for the file as it is now
    assert gguf_header_cache.load(model) is not None
    (file,) = kept.iterdir()
    file.write_bytes(file.read_bytes()[:100])
    assert gguf_header_cache.load(model) is None
    assert open_gguf(model).metadata["general.architecture"] == "llama"


def test_small_file_leaves_nothing(tmp_path, monkeypatch, model):
    monkeypatch.setenv("GGRUN_CACHE", str(tmp_path / "cache"))
    open_gguf(model)
    assert not (tmp_path / "cache" / "headers").exists()


def test_kept_header_loads_without_gguf_package(kept, model):
    """Types are kept as numbers: unpickling gguf's enum by name would import all of gguf's package."""
    import subprocess
    import sys

    open_gguf(model)
    code = ("import sys; from ggrun.cli import library_patches; library_patches.apply(); "
            "from ggrun.loaders import gguf_file, gguf_header_cache as h; h.MIN_BYTES = 0; "
            f"assert h.load({str(model)!r}) is not None; print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ})
    assert out.stdout.strip() == "False"
