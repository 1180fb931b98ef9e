"""Model validation (core.llm.checks through Model.read_hparams): every corrupt hyperparameter or tensor
directory entry is one BadInput line naming the file, the key or tensor, the value and what was expected,
before anything is allocated; good files pass."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from core.errors import BadInput
from core.llm.model import Model
from loaders.gguf_file import open_gguf
from tests.synth import Gemma3Config, LlamaConfig, tokenizer_metadata, write_variant

TOK = tokenizer_metadata()
N_VOCAB = len(TOK["tokenizer.ggml.tokens"])
LLAMA = LlamaConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=N_VOCAB, n_ctx_train=256)
GEMMA3 = Gemma3Config(n_layer=2, n_embd=64, n_head=4, n_head_kv=1, head_dim=32, n_ff=128, n_vocab=N_VOCAB,
                      n_ctx_train=256, sliding_window=8)

Edit = Callable[[dict[str, np.ndarray]], None]


def write_model(path: Path, config=LLAMA, meta: dict[str, Any] | None = None, edit: Edit | None = None) -> Path:
    return write_variant(path, config, meta=meta, edit=edit)


def rejected(path: Path) -> str:
    """The one line Model.read_hparams rejects the file with."""
    with open_gguf(path) as gf, pytest.raises(BadInput) as info:
        Model.read_hparams(gf)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and len(message) <= 300, message
    return message[len(f"{path}: "):]


def test_good_models_pass(tmp_path):
    for config in (LLAMA, GEMMA3):
        with open_gguf(write_model(tmp_path / f"{type(config).__name__}.gguf", config)) as gf:
            hp, _ = Model.read_hparams(gf)
        assert (hp.n_layer, hp.n_embd, hp.n_vocab) == (2, 64, N_VOCAB)


@pytest.mark.parametrize("key, value, expected", [
    ("llama.attention.head_count", 0, "llama.attention.head_count = 0, expected an integer from 1 to 65536"),
    ("llama.attention.head_count", None, "missing metadata key llama.attention.head_count"),
    ("llama.attention.head_count", 4.0, "llama.attention.head_count = 4, expected an integer"),
    ("llama.attention.head_count_kv", 3, "llama.attention.head_count_kv = 3, expected a divisor of "
                                         "llama.attention.head_count (4)"),
    ("llama.attention.head_count_kv", 2**31, "llama.attention.head_count_kv = 2147483648, expected an integer"),
    ("llama.block_count", 0, "llama.block_count = 0, expected an integer from 1"),
    ("llama.context_length", 0, "llama.context_length = 0, expected an integer from 1"),
    ("llama.context_length", 2**31, "llama.context_length = 2147483648, expected an integer from 1 to 67108864"),
    ("llama.feed_forward_length", 0, "llama.feed_forward_length = 0, expected an integer from 1"),
    ("llama.feed_forward_length", 2**31, "llama.feed_forward_length = 2147483648, expected an integer"),
    ("llama.embedding_length", "64", "llama.embedding_length = '64', expected an integer"),
    ("llama.vocab_size", 0, "llama.vocab_size = 0, expected an integer from 1"),
    ("llama.vocab_size", 2**31, f"llama.vocab_size = 2147483648, expected the vocabulary's {N_VOCAB} tokens"),
    ("llama.vocab_size", N_VOCAB + 1, f"llama.vocab_size = {N_VOCAB + 1}, expected the vocabulary's {N_VOCAB}"),
    ("llama.rope.dimension_count", 0, "llama.rope.dimension_count = 0, expected an integer from 1"),
    ("llama.rope.dimension_count", 15, "llama.rope.dimension_count = 15, expected an even number up to the "
                                       "head size 16"),
    ("llama.rope.dimension_count", 32, "llama.rope.dimension_count = 32, expected an even number"),
    ("llama.rope.freq_base", float("inf"), "llama.rope.freq_base = inf, expected a finite number above 0"),
    ("llama.rope.freq_base", float("nan"), "llama.rope.freq_base = nan, expected a finite number above 0"),
    ("llama.rope.freq_base", 0.0, "llama.rope.freq_base = 0, expected a finite number above 0"),
    ("llama.rope.scaling.factor", -2.0, "llama.rope.scaling.factor = -2, expected a finite number at least 0"),
    ("llama.attention.layer_norm_rms_epsilon", 1e30, "llama.attention.layer_norm_rms_epsilon = 1e+30, "
                                                     "expected a finite number above 0 and at most 1"),
    ("llama.attention.layer_norm_rms_epsilon", 0.0, "llama.attention.layer_norm_rms_epsilon = 0, expected"),
    ("tokenizer.ggml.bos_token_id", N_VOCAB, f"tokenizer.ggml.bos_token_id = {N_VOCAB}, expected a token id "
                                             f"from 0 to {N_VOCAB - 1}"),
    ("tokenizer.ggml.eos_token_id", 2**31, "tokenizer.ggml.eos_token_id = 2147483648, expected a token id"),
    ("tokenizer.ggml.padding_token_id", -7, "tokenizer.ggml.padding_token_id = -7, expected a token id"),
    ("tokenizer.ggml.model", None, "missing metadata key tokenizer.ggml.model"),
    ("tokenizer.ggml.pre", ["x"], "tokenizer.ggml.pre = an array of 1 strs, expected a string"),
    ("tokenizer.ggml.token_type", np.ones(3, dtype=np.int32), "tokenizer.ggml.token_type = an array of 3 ints, "
                                                              f"expected one entry for each of the {N_VOCAB} tokens"),
    ("tokenizer.ggml.merges", np.arange(3, dtype=np.int32), "tokenizer.ggml.merges = an array of 3 ints, "
                                                            "expected a non-empty array of strings"),
    ("tokenizer.ggml.token_type", ["a"] * N_VOCAB, f"tokenizer.ggml.token_type = an array of {N_VOCAB} strs, "
                                                   "expected a non-empty array of integers"),
])
def test_bad_metadata_value(tmp_path, key, value, expected):
    assert rejected(write_model(tmp_path / "bad.gguf", meta={key: value})).startswith(expected)


def test_head_count_must_divide_the_width_without_key_length(tmp_path):
    path = write_model(tmp_path / "bad.gguf", meta={"llama.attention.head_count": 6,
                                                    "llama.attention.head_count_kv": 2})
    assert rejected(path) == ("llama.attention.head_count = 6, expected a divisor of llama.embedding_length (64) "
                              "when llama.attention.key_length is not given")


def test_no_token_sentinel_is_accepted(tmp_path):
    """-1 (as uint32: 2^32 - 1) marks an absent special token in some converters' files."""
    path = write_model(tmp_path / "ok.gguf", meta={"tokenizer.ggml.padding_token_id": 2**32 - 1})
    with open_gguf(path) as gf:
        Model.read_hparams(gf)


def test_long_values_are_quoted_short(tmp_path):
    message = rejected(write_model(tmp_path / "bad.gguf", meta={"llama.embedding_length": "x" * 5000}))
    assert message.startswith("llama.embedding_length = 'xxxx") and "… (5,000 bytes)" in message


def _set(name: str, value: np.ndarray) -> Edit:
    return lambda tensors: tensors.__setitem__(name, value)


def _drop(name: str) -> Edit:
    return lambda tensors: tensors.pop(name)


@pytest.mark.parametrize("meta, edit, expected", [
    ({}, _set("blk.0.attn_norm.weight", np.ones(64, np.float16)),
     "tensor blk.0.attn_norm.weight has type F16, expected F32 (a norm weight)"),
    ({}, _set("output_norm.weight", np.ones(1, np.float32)),
     "tensor output_norm.weight has shape [1], expected [n_embd] = [64]"),
    ({}, _set("blk.1.ffn_norm.weight", np.ones(1, np.float32)),
     "tensor blk.1.ffn_norm.weight has shape [1], expected [n_embd] = [64]"),
    ({}, _drop("blk.1.ffn_up.weight"), "missing tensor blk.1.ffn_up.weight"),
    ({"llama.block_count": 1}, None, "tensor blk.1.attn_norm.weight lies outside blocks 0..0 (llama.block_count = 1)"),
    ({"llama.block_count": 3}, None, "missing tensor blk.2.attn_norm.weight"),
    ({"llama.attention.head_count_kv": 1}, None,
     "tensor blk.0.attn_k.weight has shape [32, 64], expected [n_head_kv * head_dim, n_embd] = [16, 64]"),
    ({"llama.feed_forward_length": 96}, None,
     "tensor blk.0.ffn_gate.weight has shape [128, 64], expected [n_ff, n_embd] = [96, 64]"),
    ({"llama.embedding_length": 32, "llama.rope.dimension_count": 8}, None,
     f"tensor token_embd.weight has shape [{N_VOCAB}, 64], expected [n_vocab, n_embd] = [{N_VOCAB}, 32]"),
    ({}, _set("output.weight", np.zeros((N_VOCAB - 1, 64), np.float32)),
     f"tensor output.weight has shape [{N_VOCAB - 1}, 64], expected [n_vocab, n_embd] = [{N_VOCAB}, 64]"),
    ({}, _set("blk.x.attn_norm.weight", np.ones(64, np.float32)),
     "tensor blk.x.attn_norm.weight lies outside blocks 0..1 (llama.block_count = 2)"),
])
def test_bad_tensor_directory(tmp_path, meta, edit, expected):
    assert rejected(write_model(tmp_path / "bad.gguf", meta=meta, edit=edit)) == expected


@pytest.mark.parametrize("meta, edit, expected", [
    ({"gemma3.attention.sliding_window": 2**31}, None, "gemma3.attention.sliding_window = 2147483648, expected"),
    ({"gemma3.attention.value_length": 16}, None, "gemma3.attention.value_length = 16, expected the key length 32"),
    ({"gemma3.attention.key_length": 0}, None, "gemma3.attention.key_length = 0, expected an integer from 1"),
    ({}, _set("blk.1.attn_q_norm.weight", np.ones(64, np.float32)),
     "tensor blk.1.attn_q_norm.weight has shape [64], expected [head_dim] = [32]"),
    ({}, _set("blk.0.post_ffw_norm.weight", np.ones(64, np.float16)),
     "tensor blk.0.post_ffw_norm.weight has type F16, expected F32 (a norm weight)"),
])
def test_bad_gemma3(tmp_path, meta, edit, expected):
    assert rejected(write_model(tmp_path / "bad.gguf", GEMMA3, meta=meta, edit=edit)).startswith(expected)
