"""Fixtures shared by the whole suite: the real SmolLM2 model (loaded once per run; tests using it
are marked slow and skip when the file is not in the cache) and synthetic tiny llama and gemma3 models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ggrun.cli import library_patches

library_patches.apply()  # as the CLI does, before the engine is imported

from gguf.constants import GGMLQuantizationType as QT  # noqa: E402

from ggrun.loaders.synthetic import write_tiny_gemma3, write_tiny_llama, written_once  # noqa: E402

DATA = Path(__file__).parent / "data"


def _smollm2_file() -> Path | None:
    """The cached SmolLM2 file, or None; never downloads (CI runs `ggrun models pull smollm2` first)."""
    from ggrun.loaders.download import KNOWN_MODELS, is_cached, model_path

    model = KNOWN_MODELS["smollm2"]
    return model_path(model) if is_cached(model) else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = _smollm2_file()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct.Q4_1.gguf is not in the ggrun cache; run `ggrun models pull smollm2`")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """SmolLM2 loaded on the CPU backend, shared by every test (about 1 s and 600 MB)."""
    from ggrun.core.backends.cpu import CPUBackend
    from ggrun.core.llm.model import Model

    return Model.load(smollm2_path, [CPUBackend()])


@pytest.fixture(scope="session")
def smollm2_reference() -> dict:
    """llama.cpp's greedy continuations and per-position scores for SmolLM2 (tests/data)."""
    return json.loads((DATA / "reference_smollm2.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory):
    """write(**options) -> path of a synthetic tiny llama (ggrun.loaders.synthetic.write_tiny_llama), written once per
    distinct set of options."""
    return written_once(write_tiny_llama, tmp_path_factory.mktemp, "tiny")


@pytest.fixture(scope="session")
def tiny_gemma3_factory(tmp_path_factory):
    """write(**options) -> path of a synthetic tiny gemma3 (ggrun.loaders.synthetic.write_tiny_gemma3), written once per
    distinct set of options."""
    return written_once(write_tiny_gemma3, tmp_path_factory.mktemp, "tiny_gemma3")


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_llama_factory) -> Path:
    """The default tiny llama: 2 layers, n_embd 64, 4 heads over 2 KV heads, f32 weights, separate head."""
    return tiny_llama_factory(weight_type=QT.F32)
