"""Model validation (core.llm.checks through Model.read_hparams): every corrupt hyperparameter or tensor
directory entry is one BadInput line naming the file, the key or tensor, the value and what was expected,
before anything is allocated; good files pass."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from ggrun.core.errors import BadInput
from ggrun.core.llm.model import Model
from ggrun.loaders.gguf_file import open_gguf
from ggrun.loaders.synthetic import Gemma3Config, LlamaConfig, tokenizer_metadata, write_variant

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
    ({"gemma3.attention.sliding_window": 0}, None, "gemma3.attention.sliding_window = 0, expected an integer from 1"),
    ({"gemma3.attention.value_length": 16}, None, "gemma3.attention.value_length = 16, expected the key length 32"),
    ({"gemma3.attention.key_length": 0}, None, "gemma3.attention.key_length = 0, expected an integer from 1"),
    ({}, _set("blk.1.attn_q_norm.weight", np.ones(64, np.float32)),
     "tensor blk.1.attn_q_norm.weight has shape [64], expected [head_dim] = [32]"),
    ({}, _set("blk.0.post_ffw_norm.weight", np.ones(64, np.float16)),
     "tensor blk.0.post_ffw_norm.weight has type F16, expected F32 (a norm weight)"),
])
def test_bad_gemma3(tmp_path, meta, edit, expected):
    assert rejected(write_model(tmp_path / "bad.gguf", GEMMA3, meta=meta, edit=edit)).startswith(expected)


# ---- GGUF types, token types and scores, tokenizer names ------------------------------------------------


@pytest.mark.parametrize("key, value, expected", [
    ("llama.block_count", np.int32(2), "metadata key llama.block_count has type INT32, expected UINT32"),
    ("llama.context_length", np.uint64(256), "metadata key llama.context_length has type UINT64, expected UINT32"),
    ("llama.rope.freq_base", np.float64(10000.0), "metadata key llama.rope.freq_base has type FLOAT64, "
                                                  "expected FLOAT32"),
    ("llama.rope.freq_base", 10000, "metadata key llama.rope.freq_base has type UINT32, expected FLOAT32"),
    ("tokenizer.ggml.bos_token_id", np.int32(5), "metadata key tokenizer.ggml.bos_token_id has type INT32, "
                                                 "expected UINT32"),
    ("tokenizer.ggml.add_bos_token", np.uint8(1), "metadata key tokenizer.ggml.add_bos_token has type UINT8, "
                                                  "expected BOOL"),
    ("general.file_type", np.int32(2), "metadata key general.file_type has type INT32, expected UINT32"),
    ("general.name", np.uint32(7), "metadata key general.name has type UINT32, expected STRING"),
    ("tokenizer.ggml.token_type", np.ones(N_VOCAB, dtype=np.uint32), "metadata key tokenizer.ggml.token_type has "
                                                                     "type ARRAY[UINT32], expected ARRAY[INT32]"),
    ("tokenizer.ggml.scores", np.zeros(N_VOCAB, dtype=np.int32), "metadata key tokenizer.ggml.scores has type "
                                                                 "ARRAY[INT32], expected ARRAY[FLOAT32]"),
])
def test_keys_have_the_types_llama_cpp_reads(tmp_path, key, value, expected):
    """A UINT32 retyped INT32 or FLOAT32 keeps the file readable (same size) but is a corrupt type code."""
    assert rejected(write_model(tmp_path / "bad.gguf", meta={key: value})) == expected


def test_an_absent_token_may_be_minus_one_as_int32(tmp_path):
    path = write_model(tmp_path / "ok.gguf", meta={"tokenizer.ggml.padding_token_id": -1})
    with open_gguf(path) as gf:
        Model.read_hparams(gf)


def test_unknown_keys_keep_any_type(tmp_path):
    path = write_model(tmp_path / "ok.gguf", meta={"some.tool.flag": np.int8(3), "general.base_model.0.name": "x"})
    with open_gguf(path) as gf:
        Model.read_hparams(gf)


def _token_types(bad_at: int, value: int) -> np.ndarray:
    types = np.array(TOK["tokenizer.ggml.token_type"], dtype=np.int32)
    types[bad_at] = value
    return types


@pytest.mark.parametrize("key, value, expected", [
    ("tokenizer.ggml.token_type", _token_types(7, 99), "tokenizer.ggml.token_type[7] = 99, expected a token type "
                                                       "from 0 to 6"),
    ("tokenizer.ggml.token_type", _token_types(0, -1), "tokenizer.ggml.token_type[0] = -1, expected a token type"),
    ("tokenizer.ggml.scores", np.array([0.0] * 5 + [np.nan] + [0.0] * (N_VOCAB - 6), dtype=np.float32),
     "tokenizer.ggml.scores[5] = nan, expected a finite number"),
    ("tokenizer.ggml.model", "gpt3", "tokenizer.ggml.model = 'gpt3', expected 'gpt2' (BPE) or 'llama' "
                                     "(SentencePiece), the tokenizers ggrun supports"),
    ("tokenizer.ggml.pre", "no-such-pre", "tokenizer.ggml.pre = 'no-such-pre', expected one of the "),
])
def test_tokenizer_values_and_names(tmp_path, key, value, expected):
    """Token types and scores the tokenizer would misread, and tokenizer names it cannot build, are rejected
    naming the file (the tokenizer's own errors do not know it)."""
    assert rejected(write_model(tmp_path / "bad.gguf", meta={key: value})).startswith(expected)


def test_a_sentencepiece_tokenizer_ignores_the_pre_tokenizer_name(tmp_path):
    """As llama.cpp: only BPE tokenizers have a pre-tokenizer, so an unknown name is no error for 'llama'."""
    scores = np.zeros(N_VOCAB, dtype=np.float32)
    path = write_model(tmp_path / "ok.gguf", meta={"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "whatever",
                                                   "tokenizer.ggml.scores": scores})
    with open_gguf(path) as gf:
        Model.read_hparams(gf)
