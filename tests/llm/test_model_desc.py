"""core.llm.model_desc: llama.cpp's model description (llama-bench's model column) from GGUF metadata:
the file type named from general.file_type or guessed from the tensors, and llama.cpp's size classes."""
from __future__ import annotations

import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.core.llm.model_desc import file_type_name, model_description, size_class
from ggrun.loaders.gguf_file import open_gguf
from ggrun.loaders.synthetic import write_tiny_llama


@pytest.mark.parametrize("arch, n_layer, n_vocab, heads, want", [
    ("llama", 30, 49152, (9, 3), "256M"),  # SmolLM2-135M: llama.cpp calls 30 layers 256M
    ("llama", 32, 32000, (32, 32), "7B"),
    ("llama", 32, 49152, (32, 8), "3B"),
    ("llama", 32, 128256, (32, 8), "8B"),
    ("llama", 80, 32000, (64, 8), "70B"),
    ("gemma3", 18, 262144, (4, 1), "270M"),
    ("gemma3", 2, 300, (4, 1), "?B"),
    ("mamba", 30, 100, (1, 1), "?B"),
])
def test_size_class(arch, n_layer, n_vocab, heads, want):
    assert size_class(arch, n_layer, n_vocab, *heads) == want


@pytest.mark.parametrize("file_type, want", [(15, "Q4_K - Medium"), (3, "Q4_1"), (0, "all F32"), (7, "Q8_0"),
                                              (99, "unknown, may not work")])
def test_file_type_from_metadata(tmp_path, file_type, want):
    path = write_tiny_llama(tmp_path / "m.gguf", extra_metadata={"general.file_type": file_type})
    with open_gguf(path) as gf:
        assert file_type_name(gf) == want
        assert model_description(gf, 2, 300, 4, 2) == f"llama ?B {want}"


def test_file_type_guessed_from_the_most_common_tensor_type(tmp_path):
    """No general.file_type: 16 Q8_0 matrices outnumber the 5 F32 norms, so llama.cpp says '(guessed) Q8_0'."""
    path = write_tiny_llama(tmp_path / "q8.gguf", weight_type=QT.Q8_0)
    with open_gguf(path) as gf:
        assert gf.get("general.file_type") is None
        assert file_type_name(gf) == "(guessed) Q8_0"
