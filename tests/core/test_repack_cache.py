"""Repacked weights kept on disk (core/backends/cpu/repack_cache.py): a second load maps what the first
made, byte for byte and with the same logits; a changed model file or a damaged cache file is repacked
again; a small model leaves no file."""
from __future__ import annotations

import os

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cpu import matmul
from ggrun.core.backends.cpu import repack_cache
from ggrun.core.llm.model import Model
from ggrun.loaders.synthetic import write_tiny_llama
from tests.llm.test_tiny_llama import PROMPT, all_logits, session


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty ggrun cache in which even a tiny model's repacked weights are kept."""
    monkeypatch.setenv("GGRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(repack_cache, "MIN_BYTES", 0)
    return tmp_path / "cache" / "repacked"


@pytest.fixture
def model_path(tmp_path):
    return write_tiny_llama(tmp_path / "q4_1.gguf", weight_type=QT.Q4_1, tied_output=True)


def repacked(model: Model) -> dict:
    return {name: t.params[matmul.REPACKED] for name, t in model.weights.tensors.items()
            if matmul.REPACKED in t.params}


def arrays(packed) -> tuple:
    """A repacked weight's arrays (an r8 array, or the ri64 layout's three)."""
    return tuple(packed) if isinstance(packed, tuple) else (packed,)


def test_second_load_maps_what_the_first_made(cache, model_path):
    first = Model.load(model_path, [CPUBackend()])
    assert len(list(cache.iterdir())) == 1
    second = Model.load(model_path, [CPUBackend()])
    made, mapped = repacked(first), repacked(second)
    assert made.keys() == mapped.keys() and "token_embd.weight" in made
    for name, packed in mapped.items():
        for a, b in zip(arrays(packed), arrays(made[name]), strict=True):
            assert not a.flags.owndata and a.flags.writeable  # a view of the file, typed as repack's arrays
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(all_logits(session(second), PROMPT), all_logits(session(first), PROMPT))


def test_changed_model_or_damaged_cache_is_repacked(cache, model_path):
    Model.load(model_path, [CPUBackend()])
    (file,) = cache.iterdir()
    st = model_path.stat()
    os.utime(model_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert repack_cache.RepackCache.for_model(model_path).get("blk.0.attn_q.weight") is None
    Model.load(model_path, [CPUBackend()])  # rewrites it for the file as it is now
    assert repack_cache.RepackCache.for_model(model_path).get("blk.0.attn_q.weight") is not None
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 1)
    assert repack_cache.RepackCache.for_model(model_path).get("blk.0.attn_q.weight") is None


def test_small_model_leaves_no_file(tmp_path, monkeypatch, model_path):
    monkeypatch.setenv("GGRUN_CACHE", str(tmp_path / "cache"))
    Model.load(model_path, [CPUBackend()])
    assert not (tmp_path / "cache" / "repacked").exists()
