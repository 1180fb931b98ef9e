"""The synthetic model writers produce files that open_gguf accepts, with the metadata and tensors asked for."""
from __future__ import annotations

import os

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from ggrun.loaders.gguf_file import open_gguf
from ggrun.loaders.synthetic import (EOT, RANDOM_BLOCK_SCALES, SPEED_PRESETS, TINY_MERGES, WEIGHT_TYPES, _random_blocks,
                                     _speed_type, bytes_to_unicode, tokenizer_from_file, tokenizer_metadata,
                                     write_sparse_big, write_synthetic, write_tiny_llama)
from ggrun.loaders.tokenizer import Tokenizer

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")


def test_tiny_llama_metadata(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", n_layer=3, n_embd=32, n_head=4, n_head_kv=1, n_ff=96,
                            n_ctx_train=128, rope_base=5000.0)
    with open_gguf(path) as f:
        assert f.arch == "llama"
        assert f.require("llama.block_count") == 3
        assert f.require("llama.embedding_length") == 32
        assert f.require("llama.attention.head_count") == 4
        assert f.require("llama.attention.head_count_kv") == 1
        assert f.require("llama.feed_forward_length") == 96
        assert f.require("llama.context_length") == 128
        assert f.require("llama.rope.freq_base") == 5000.0
        assert f.require("llama.rope.dimension_count") == 8
        assert f.require("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)


def test_tiny_llama_tensors(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128)
    with open_gguf(path) as f:
        n_vocab = len(f.require("tokenizer.ggml.tokens"))
        expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
        expected |= {f"blk.{i}.{t}.weight" for i in range(2) for t in LAYER_TENSORS}
        assert set(f.tensors) == expected
        assert f.tensors["token_embd.weight"].shape == (n_vocab, 64)
        assert f.tensors["blk.1.attn_k.weight"].shape == (32, 64)
        assert f.tensors["blk.1.ffn_down.weight"].shape == (64, 128)
        assert f.tensors["blk.0.attn_norm.weight"].shape == (64,)
        w = f.load_f32("blk.0.attn_q.weight")
        assert 0.05 < w.std() < 0.25 and np.isfinite(w).all()


def test_tied_output_has_no_output_tensor(tmp_path):
    with open_gguf(write_tiny_llama(tmp_path / "m.gguf", tied_output=True)) as f:
        assert "output.weight" not in f.tensors


@pytest.mark.parametrize("weight_type", sorted(WEIGHT_TYPES), ids=lambda t: t.name)
def test_weight_types(tmp_path, weight_type):
    with open_gguf(write_tiny_llama(tmp_path / "m.gguf", weight_type=weight_type, seed=3)) as f:
        assert f.tensors["blk.0.ffn_up.weight"].qtype == weight_type
        assert f.tensors["blk.0.ffn_norm.weight"].qtype == QT.F32
        assert np.isfinite(f.load_f32("output.weight")).all()


def test_seed_decides_the_weights(tmp_path):
    a = write_tiny_llama(tmp_path / "a.gguf", seed=1)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=1)
    c = write_tiny_llama(tmp_path / "c.gguf", seed=2)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_tokenizer_is_consistent(tmp_path):
    with open_gguf(write_tiny_llama(tmp_path / "m.gguf", n_vocab=300)) as f:
        tokens = f.require("tokenizer.ggml.tokens")
        types = f.require("tokenizer.ggml.token_type")
        merges = f.require("tokenizer.ggml.merges")
        assert f.require("tokenizer.ggml.model") == "gpt2"
        assert f.require("tokenizer.ggml.pre") == "default"
        assert len(tokens) == len(types) == 300 == f.tensors["output.weight"].shape[0]
        assert tokens[:256] == [bytes_to_unicode()[b] for b in range(256)]
        assert merges == list(TINY_MERGES)
        known = set(tokens)
        for merge in merges:
            left, right = merge.split(" ")
            assert left in known and right in known and left + right in known
        eot = tokens.index(EOT)
        assert f.require("tokenizer.ggml.bos_token_id") == f.require("tokenizer.ggml.eos_token_id") == eot
        assert types[eot] == 3 and types[0] == 1


def test_bytes_to_unicode_is_gpt2s():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("a")] == "a"


def test_extra_metadata(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", extra_metadata={"tokenizer.chat_template": "{{ x }}"})
    with open_gguf(path) as f:
        assert f.require("tokenizer.chat_template") == "{{ x }}"


def test_unquantizable_weight_type_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Q4_K"):
        write_tiny_llama(tmp_path / "m.gguf", weight_type=QT.Q4_K)


def test_sparse_big_is_huge_but_takes_no_disk(tmp_path):
    path = write_sparse_big(tmp_path / "big.gguf")
    size = path.stat().st_size
    assert size > 3 * 2 ** 30
    assert os.stat(path).st_blocks * 512 < 16 * 2 ** 20
    with open_gguf(path) as f:
        assert f.arch == "llama" and f.require("llama.block_count") == 32
        assert f.tensors["blk.31.ffn_down.weight"].qtype == QT.Q4_K
        assert f.tensors["blk.31.ffn_down.weight"].shape == (4096, 14336)
        assert f.file_bytes > 3 * 2 ** 30
        assert len(f.require("tokenizer.ggml.tokens")) == f.tensors["token_embd.weight"].shape[0]


@pytest.mark.parametrize("qtype", sorted(RANDOM_BLOCK_SCALES), ids=lambda t: t.name)
def test_random_blocks_stay_small(qtype):
    """write_synthetic's random blocks decode to values within about Q4_0's at BLOCK_SCALE, not all alike."""
    raw = _random_blocks(np.random.default_rng(0), "blk.0.ffn_up.weight", (8, 256), qtype)
    values = dequantize(raw, qtype)
    assert np.isfinite(values).all() and np.abs(values).max() < 0.1 and values.std() > 1e-3


def test_speed_preset_types():
    """gpt-oss-20b ships MXFP4 experts beside Q8_0 matrices, F32 routers and biases; rows that are not whole
    blocks of the type asked for are refused."""
    spec = SPEED_PRESETS["gpt-oss-20b"]
    types = {name: _speed_type(spec, name, shape, QT.MXFP4) for name, shape in spec.config.tensor_shapes().items()}
    assert types["blk.3.ffn_up_exps.weight"] == QT.MXFP4
    assert types["blk.3.attn_q.weight"] == types["output.weight"] == QT.Q8_0
    assert types["blk.3.ffn_gate_inp.weight"] == types["blk.3.ffn_up_exps.bias"] == QT.F32
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        write_synthetic(os.devnull, "gpt-oss-20b", QT.Q4_K)


def test_write_synthetic_qwen3(tmp_path):
    """A Qwen3-0.6B-shaped Q4_K file: the family's tensors (QK-norms, tied head), its head size, finite weights."""
    path = write_synthetic(tmp_path / "q.gguf", "qwen3-0.6b", QT.Q4_K)
    with open_gguf(path) as f:
        assert f.arch == "qwen3" and f.require("qwen3.attention.key_length") == 128
        assert set(f.tensors) == set(SPEED_PRESETS["qwen3-0.6b"].config.tensor_shapes())
        assert f.tensors["blk.27.attn_q.weight"].qtype == QT.Q4_K
        assert f.tensors["blk.27.attn_k_norm.weight"].shape == (128,)
        w = f.load_f32("blk.0.ffn_down.weight")
        assert np.isfinite(w).all() and np.abs(w).max() < 0.1


def test_text_padding_detokenizes_to_text():
    """The speed models' padding tokens are normal ones that read as words (a random model picks them mostly, and
    control tokens render as nothing: no server would stream any text), all distinct, none made by a merge."""
    md = tokenizer_metadata(2000, text_padding=True)
    tok = Tokenizer.from_metadata(md)
    assert list(md["tokenizer.ggml.token_type"][277:]) == [1] * (2000 - 277)
    assert [tok.detokenize([i]) for i in (277, 1999)] == [" w0", " w1722"]
    assert len(set(md["tokenizer.ggml.tokens"])) == 2000
    assert tok.tokenize(" w1722", add_special=False) != [1999]
    control = Tokenizer.from_metadata(tokenizer_metadata(2000))
    assert control.detokenize([1999]) == ""


def test_tokenizer_from_file_pads_a_real_vocabulary(tmp_path):
    """Another GGUF's tokenizer keys come over with their types, chat template included; its vocabulary is padded
    with text tokens to the size asked for (none when it has as many); padding other than BPE's is refused."""
    src = write_tiny_llama(tmp_path / "src.gguf", n_vocab=300, extra_metadata={"tokenizer.chat_template": "{{ x }}"})
    md = tokenizer_from_file(src, 1000)
    with open_gguf(src) as f:
        tokens = f.require("tokenizer.ggml.tokens")
    assert md["tokenizer.ggml.tokens"][:300] == tokens and len(md["tokenizer.ggml.tokens"]) == 1000
    assert md["tokenizer.chat_template"] == "{{ x }}" and md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.token_type"].dtype == np.int32 and md["tokenizer.ggml.bos_token_id"].dtype == np.uint32
    assert list(md["tokenizer.ggml.token_type"][300:]) == [1] * 700
    assert Tokenizer.from_metadata(md).detokenize([999]) != ""
    assert tokenizer_from_file(src, 300)["tokenizer.ggml.tokens"] == tokens
    spm = write_tiny_llama(tmp_path / "spm.gguf", extra_metadata={"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="gpt2"):
        tokenizer_from_file(spm, 1000)


def test_write_synthetic_takes_a_larger_tokenizer(tmp_path):
    """A tokenizer larger than the preset's vocabulary sizes the embedding (tied head) to itself."""
    src = write_tiny_llama(tmp_path / "src.gguf", n_vocab=49160, n_layer=1, n_embd=32, n_head=2, n_head_kv=1,
                           n_ff=32, tied_output=True, extra_metadata={"tokenizer.chat_template": "{{ y }}"})
    path = write_synthetic(tmp_path / "m.gguf", "llama-135m", QT.Q4_0, tokenizer_from=src)
    with open_gguf(path) as f:
        assert f.tensors["token_embd.weight"].shape == (49160, 576)
        assert len(f.require("tokenizer.ggml.tokens")) == 49160
        assert f.require("tokenizer.chat_template") == "{{ y }}"
