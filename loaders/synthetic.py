"""Write synthetic GGUF files for tests and scripts: tiny models of every family ggrun runs (llama, gemma3,
and through FamilyConfig qwen2, qwen3, qwen3moe, gemma2, phi3, gpt-oss) with random weights and a tiny
byte-level BPE tokenizer, models of real shapes (SPEED_PRESETS) of random blocks for speed measurements,
and huge sparse ones whose tensor data never reaches the disk.

For tests and scripts only (the engine never calls it): it writes files with gguf's writer and never
imports the rest of ggrun, so that the files it writes check ggrun's reader against something written apart.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.gguf_reader import ReaderField
from gguf.quants import quantize

# llama.cpp's token types (llama_token_type).
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3

EOT = "<|endoftext|>"

# Merges of the tiny BPE tokenizer, in priority order; each side is a byte symbol or an earlier result.
TINY_MERGES: tuple[str, ...] = (
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "a t", "e n",
    "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ i", "Ġi n",
)

# Types write_tiny_llama can store weight matrices in (those gguf.quants can quantize).
WEIGHT_TYPES: frozenset[QT] = frozenset({QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
                                         QT.MXFP4})
# write_tiny_family adds Q4_K, IQ4_NL and IQ4_XS (encoded here: gguf.quants has no encoder for them); rows of
# Q4_K and IQ4_XS must be whole 256-value super-blocks.
FAMILY_WEIGHT_TYPES: frozenset[QT] = WEIGHT_TYPES | {QT.Q4_K, QT.IQ4_NL, QT.IQ4_XS}

# ggml's kvalues_iq4nl: the 16 values an IQ4_NL/IQ4_XS index stands for.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)

# numpy scalar types map to the GGUF value type of the same width; plain Python values follow
# llama.cpp's conventions (counts are uint32, floats float32, token types int32).
_NUMPY_VALUE_TYPES: dict[np.dtype, GGUFValueType] = {
    np.dtype(np.uint8): GGUFValueType.UINT8, np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16, np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32, np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.uint64): GGUFValueType.UINT64, np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float32): GGUFValueType.FLOAT32, np.dtype(np.float64): GGUFValueType.FLOAT64,
    np.dtype(np.bool_): GGUFValueType.BOOL,
}
_VALUE_DTYPES: dict[GGUFValueType, np.dtype] = {v: k for k, v in _NUMPY_VALUE_TYPES.items()}


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a llama-architecture model, enough to write its metadata and tensor shapes."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    tied_output: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def metadata(self) -> dict[str, Any]:
        return {
            "general.name": "synthetic llama",
            "llama.context_length": self.n_ctx_train,
            "llama.embedding_length": self.n_embd,
            "llama.block_count": self.n_layer,
            "llama.feed_forward_length": self.n_ff,
            "llama.attention.head_count": self.n_head,
            "llama.attention.head_count_kv": self.n_head_kv,
            "llama.rope.freq_base": float(self.rope_base),
            "llama.attention.layer_norm_rms_epsilon": float(self.rms_eps),
            "llama.rope.dimension_count": self.head_dim,
            "llama.vocab_size": self.n_vocab,
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """llama.cpp's tensor names with shapes in numpy order (a matrix is (out, in))."""
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, self.n_embd)}
        for i in range(self.n_layer):
            shapes |= {
                f"blk.{i}.attn_norm.weight": (self.n_embd,),
                f"blk.{i}.attn_q.weight": (q_dim, self.n_embd),
                f"blk.{i}.attn_k.weight": (kv_dim, self.n_embd),
                f"blk.{i}.attn_v.weight": (kv_dim, self.n_embd),
                f"blk.{i}.attn_output.weight": (self.n_embd, q_dim),
                f"blk.{i}.ffn_norm.weight": (self.n_embd,),
                f"blk.{i}.ffn_gate.weight": (self.n_ff, self.n_embd),
                f"blk.{i}.ffn_up.weight": (self.n_ff, self.n_embd),
                f"blk.{i}.ffn_down.weight": (self.n_embd, self.n_ff),
            }
        shapes["output_norm.weight"] = (self.n_embd,)
        if not self.tied_output:
            shapes["output.weight"] = (self.n_vocab, self.n_embd)
        return shapes


@dataclass(frozen=True)
class Gemma3Config:
    """Hyperparameters of a gemma3-architecture model: head_dim is its own key (not n_embd / n_head), the
    output head is always tied to the embedding, and 5 of every 6 layers attend within a sliding window."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    sliding_window: int
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6

    def metadata(self) -> dict[str, Any]:
        return {
            "general.name": "synthetic gemma3",
            "gemma3.context_length": self.n_ctx_train,
            "gemma3.embedding_length": self.n_embd,
            "gemma3.block_count": self.n_layer,
            "gemma3.feed_forward_length": self.n_ff,
            "gemma3.attention.head_count": self.n_head,
            "gemma3.attention.head_count_kv": self.n_head_kv,
            "gemma3.attention.key_length": self.head_dim,
            "gemma3.attention.value_length": self.head_dim,
            "gemma3.attention.layer_norm_rms_epsilon": float(self.rms_eps),
            "gemma3.rope.freq_base": float(self.rope_base),
            "gemma3.attention.sliding_window": self.sliding_window,
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """llama.cpp's gemma3 tensor names with shapes in numpy order (a matrix is (out, in))."""
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, self.n_embd)}
        for i in range(self.n_layer):
            shapes |= {
                f"blk.{i}.attn_norm.weight": (self.n_embd,),
                f"blk.{i}.attn_q.weight": (q_dim, self.n_embd),
                f"blk.{i}.attn_k.weight": (kv_dim, self.n_embd),
                f"blk.{i}.attn_v.weight": (kv_dim, self.n_embd),
                f"blk.{i}.attn_q_norm.weight": (self.head_dim,),
                f"blk.{i}.attn_k_norm.weight": (self.head_dim,),
                f"blk.{i}.attn_output.weight": (self.n_embd, q_dim),
                f"blk.{i}.post_attention_norm.weight": (self.n_embd,),
                f"blk.{i}.ffn_norm.weight": (self.n_embd,),
                f"blk.{i}.ffn_gate.weight": (self.n_ff, self.n_embd),
                f"blk.{i}.ffn_up.weight": (self.n_ff, self.n_embd),
                f"blk.{i}.ffn_down.weight": (self.n_embd, self.n_ff),
                f"blk.{i}.post_ffw_norm.weight": (self.n_embd,),
            }
        shapes["output_norm.weight"] = (self.n_embd,)
        return shapes


# What each family's file holds beyond llama's layer: extra per-layer tensors, fused matrices, its keys.
FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe", "gpt-oss")
_NEOX_HEAD_NORMS = ("attn_q_norm", "attn_k_norm")


@dataclass(frozen=True)
class FamilyConfig:
    """Hyperparameters of a model of any family in FAMILIES, enough to write its metadata and tensor shapes.
    head_dim is written as attention.key_length (qwen3 and the gemmas: it need not be n_embd / n_head);
    the gemmas tie their head to the embedding; sliding_window serves gemma2/gemma3."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int = 4096
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    tied_output: bool = False
    sliding_window: int = 16
    attn_softcap: float = 1.5  # gemma2: caps small enough to bind on a tiny model's scores and logits
    final_softcap: float = 15.0
    n_expert: int = 8  # qwen3moe: experts of n_ff_exp rows, n_expert_used of them per token
    n_expert_used: int = 2
    n_ff_exp: int = 256
    yarn_factor: float = 32.0  # gpt-oss: YaRN's context extension as gpt-oss-20b has it (131072 over 4096)
    n_ctx_orig: int = 4096

    def metadata(self) -> dict[str, Any]:
        a = self.arch
        md = {
            "general.name": "tiny synthetic model",  # not "phi3": llama.cpp then looks for Phi-3's own tokens
            f"{a}.context_length": self.n_ctx_train,
            f"{a}.embedding_length": self.n_embd,
            f"{a}.block_count": self.n_layer,
            f"{a}.feed_forward_length": self.n_ff,
            f"{a}.attention.head_count": self.n_head,
            f"{a}.attention.head_count_kv": self.n_head_kv,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.rope.freq_base": float(self.rope_base),
            f"{a}.rope.dimension_count": self.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": float(self.rms_eps),
        }
        if a in ("gemma2", "gemma3", "gpt-oss"):
            md[f"{a}.attention.sliding_window"] = self.sliding_window
        if a in ("qwen3moe", "gpt-oss"):
            md |= {f"{a}.expert_count": self.n_expert, f"{a}.expert_used_count": self.n_expert_used,
                   f"{a}.expert_feed_forward_length": self.n_ff_exp}
        if a == "gpt-oss":
            md |= {"gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": self.yarn_factor,
                   "gpt-oss.rope.scaling.original_context_length": self.n_ctx_orig}
        if a == "gemma2":
            md |= {"gemma2.attn_logit_softcapping": self.attn_softcap,
                   "gemma2.final_logit_softcapping": self.final_softcap}
        return md

    @property
    def tied(self) -> bool:
        return self.tied_output or self.arch in ("gemma2", "gemma3")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """llama.cpp's tensor names of the family with shapes in numpy order (a matrix is (out, in))."""
        n, ff, q, kv = self.n_embd, self.n_ff, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, n)}
        for i in range(self.n_layer):
            layer: dict[str, tuple[int, ...]] = {"attn_norm.weight": (n,)}
            if self.arch in ("qwen3moe", "gpt-oss"):  # (the order is that of the random draws)
                e, fe = self.n_expert, self.n_ff_exp
                layer |= {"attn_q.weight": (q, n), "attn_k.weight": (kv, n), "attn_v.weight": (kv, n),
                          "attn_output.weight": (n, q)}
                if self.arch == "qwen3moe":
                    layer["ffn_norm.weight"] = (n,)
                layer |= {"ffn_gate_inp.weight": (e, n), "ffn_gate_exps.weight": (e, fe, n),
                          "ffn_up_exps.weight": (e, fe, n), "ffn_down_exps.weight": (e, n, fe)}
                if self.arch == "gpt-oss":
                    layer |= {"post_attention_norm.weight": (n,), "attn_q.bias": (q,), "attn_k.bias": (kv,),
                              "attn_v.bias": (kv,), "attn_output.bias": (n,), "attn_sinks.weight": (self.n_head,),
                              "ffn_gate_inp.bias": (e,), "ffn_gate_exps.bias": (e, fe), "ffn_up_exps.bias": (e, fe),
                              "ffn_down_exps.bias": (e, n)}
            elif self.arch == "phi3":
                layer |= {"attn_qkv.weight": (q + 2 * kv, n), "attn_output.weight": (n, q), "ffn_norm.weight": (n,),
                          "ffn_up.weight": (2 * ff, n), "ffn_down.weight": (n, ff)}
            else:
                layer |= {"attn_q.weight": (q, n), "attn_k.weight": (kv, n), "attn_v.weight": (kv, n),
                          "attn_output.weight": (n, q), "ffn_norm.weight": (n,), "ffn_gate.weight": (ff, n),
                          "ffn_up.weight": (ff, n), "ffn_down.weight": (n, ff)}
            if self.arch == "qwen2":
                layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
            if self.arch in ("qwen3", "qwen3moe", "gemma3"):
                layer |= {f"{t}.weight": (self.head_dim,) for t in _NEOX_HEAD_NORMS}
            if self.arch in ("gemma2", "gemma3"):
                layer |= {"post_attention_norm.weight": (n,), "post_ffw_norm.weight": (n,)}
            shapes |= {f"blk.{i}.{k}": v for k, v in layer.items()}
        shapes["output_norm.weight"] = (n,)
        if not self.tied:
            shapes["output.weight"] = (self.n_vocab, n)
        return shapes


# The tiny model of each family that tests/llm/test_families.py and scripts/bench/arch_vs_llama.py compare with
# llama.cpp (write_tiny_family's options beyond its defaults: n_embd 256, so that every matrix row is whole
# Q4_K super-blocks): qwen3 and the gemmas get a head size apart from n_embd / n_head (8 heads of 64), gemma3
# seven layers so that a global layer (5) sits among the sliding-window ones; gpt-oss two layers (one in the
# window, one global) and gpt-oss-20b's RoPE base: with four, its 8-bit activation rounding (MXFP4) moves the
# top token at 11% of positions in llama.cpp against itself (-ub 16), with two at 4.6%.
FAMILY_PRESETS: dict[str, dict[str, Any]] = {
    "llama": {}, "qwen2": {}, "phi3": {},
    "qwen3": {"n_head": 8}, "gemma2": {"n_head": 8}, "gemma3": {"n_layer": 7, "n_head": 8},
    "qwen3moe": {"n_head": 8}, "gpt-oss": {"n_layer": 2, "n_head": 8, "rope_base": 150000.0},
}
# Variants of a family's tiny model compared with llama.cpp as well ("family+variant": the family, and options
# beside its preset): Phi-3's LongRoPE, scored at -c 128 within its original context (the short factors) and
# past it (the long ones); Llama 3's rope_freqs.
FAMILY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3+longrope_short": ("phi3", {"longrope": 4096}), "phi3+longrope_long": ("phi3", {"longrope": 64}),
    "llama+rope_freqs": ("llama", {"rope_freqs": True}),
}
LONGROPE_ATTN_FACTOR = 1.1902  # Phi-3-mini-128k's: sqrt(1 + ln(131072 / 4096) / ln(4096))


# What a tiny model stored in a block type (8-bit activation rounding, as ggml's vec_dot types) adds to its family's
# preset: a bigram echo, so that its top tokens lead by more than that rounding moves them. On the plain models the
# rounding alone (llama.cpp against itself at -ub 16, or any two kernels whose float sums differ in the last bit:
# a rounding step that flips then feeds the next product) moves the top token at 3-8% of positions, where the top
# two logits are near ties. The echo makes the model predict, after token t, a fixed other token perm[t] (the
# output rows of _echo_rows over an embedding `embd_scale` times the others' size, so that it stays a large part
# of the stream): at ~85-98% of positions that token leads by several logits' spread, and the layers still shape
# the rest of the distribution, where a wrong formula shows in the KL divergence (scripts/bench/arch_vs_llama.py
# --mutations). gpt-oss's experts (biases, clamped SwiGLU) write ~10x more into the stream, so its embedding is
# 10x larger again. The gemmas tie their head to the embedding (which they scale by sqrt(n_embd)), so their echo is
# the input token itself, and their post-norms are left near 1 instead of `post_norm`'s 4. The F32 and F16
# models stay plain against llama.cpp's CPU, which they match to the last bits, so the layers alone rank every
# top token there; they take the echo too where a GPU's f16 tiles round (family_options' `robust`).
QUANTIZED_OPTIONS: dict[str, dict[str, Any]] = {
    "gemma2": {"post_norm": 1.0}, "gemma3": {"post_norm": 0.9}, "gpt-oss": {"embd_scale": 100.0, "echo": 1.0},
}
QUANTIZED_DEFAULT = {"embd_scale": 10.0, "echo": 1.0}


def family_options(name: str, weight_type: QT = QT.F32, robust: bool | None = None) -> tuple[str, dict[str, Any]]:
    """The family and write_tiny_family's options of a tiny model's name, a family (FAMILY_PRESETS) or a variant
    (FAMILY_VARIANTS), stored as `weight_type`: a block type adds QUANTIZED_OPTIONS, and so does any type with
    `robust` (where two sides round differently though neither rounds to 8 bits: a GPU's f16 tiles against the
    CPU's f32 products)."""
    arch, options = FAMILY_VARIANTS.get(name, (name, {}))
    if robust is None:
        robust = QT(weight_type) not in (QT.F32, QT.F16)
    return arch, FAMILY_PRESETS[arch] | options | (QUANTIZED_OPTIONS.get(arch, QUANTIZED_DEFAULT) if robust else {})


def drop_biases(tensors: dict[str, Any]) -> None:
    """write_tiny_family's `edit` that leaves every bias out (a model that adds none where its family does)."""
    for name in [n for n in tensors if n.endswith(".bias")]:
        del tensors[name]


def _echo_rows(embd: np.ndarray, scale: float, seed: int) -> np.ndarray:
    """Rows that make the output head predict, after token t, token perm[t] (a fixed random permutation): row
    perm[t] is t's embedding as a unit vector times `scale`."""
    perm = np.random.default_rng(seed + 1).permutation(len(embd))
    rows = np.empty_like(embd)
    rows[perm] = embd / np.linalg.norm(embd, axis=1, keepdims=True)
    return rows * np.float32(scale)


def _add_longrope(tensors: dict[str, Any], metadata: dict[str, Any], half: int, n_ctx_orig: int) -> None:
    """Phi-3's LongRoPE: frequency factors (f32 [n_rot / 2]) for contexts past the original one (rising from 1
    to 16 over the pairs) and within it (1 to 1.5), its attention factor and its original context."""
    tensors["rope_factors_long.weight"] = np.geomspace(1.0, 16.0, half).astype(np.float32)
    tensors["rope_factors_short.weight"] = np.linspace(1.0, 1.5, half).astype(np.float32)
    metadata["phi3.rope.scaling.attn_factor"] = np.float32(LONGROPE_ATTN_FACTOR)
    metadata["phi3.rope.scaling.original_context_length"] = np.uint32(n_ctx_orig)


def write_tiny_family(path: str | os.PathLike[str], arch: str, *, n_layer: int = 4, n_embd: int = 256,
                      n_head: int = 4, n_head_kv: int = 2, head_dim: int = 64, n_ff: int = 512,
                      n_vocab: int | None = None, weight_type: QT = QT.F32, peak: float = 4.0,
                      post_norm: float = 4.0, router_scale: float = 8.0, sliding_window: int = 16, tied_output: bool = False,
                      rope_base: float = 10000.0, seed: int = 0, longrope: int = 0, rope_freqs: bool = False,
                      echo: float = 0.0, embd_scale: float = 1.0,
                      extra_metadata: Mapping[str, Any] | None = None,
                      edit: Callable[[dict[str, Any]], None] | None = None, arch_name: str | None = None) -> Path:
    """Write a small model of family `arch` (FAMILIES) with random weights and the tiny BPE tokenizer.

    Weights are drawn as write_tiny_llama draws them (matrices N(0, 1/fan_in), norms near 1 in F32, biases
    N(0, 0.5^2) in F32); the logits are then scaled by `peak` (the output matrix, or with a tied head the
    output norm's weights) so that the next-token distributions are peaked (top probabilities well above
    the vocabulary's flat 1/n), where a wrong formula shows at once. A tied head would mostly predict the
    input token again (its embedding is the stream's largest part), so the gemmas' post-norm weights are
    scaled by `post_norm`, making the layers' contributions outweigh it. A mixture of experts' router is
    scaled by `router_scale`, so that near ties between experts (where a last-bit difference picks another
    expert, in llama.cpp as in ggrun) are rare. Matrices are stored in
    `weight_type` (FAMILY_WEIGHT_TYPES). With `longrope` (phi3), LongRoPE's factors and keys, its original
    context that many tokens (_add_longrope); with `rope_freqs` (llama), Llama 3's frequency factors (f32
    [n_rot / 2] from 1 to 8 over the pairs). With `echo`, the head (not a tied one) also predicts a fixed token
    after each token (_echo_rows, `echo` times the random rows' size); `embd_scale` scales the embedding
    (QUANTIZED_OPTIONS says why both). Changed on purpose: `edit` changes the dict of tensors in place
    before it is written, and `arch_name` writes the file as another general.architecture (its keys too)."""
    weight_type = QT(weight_type)
    if arch not in FAMILIES:
        raise ValueError(f"unknown family {arch}; known: {', '.join(FAMILIES)}")
    if weight_type not in FAMILY_WEIGHT_TYPES:
        raise ValueError(f"weight_type {weight_type.name} is not one the writer can encode")
    tok_meta = tokenizer_metadata(n_vocab)
    config = FamilyConfig(arch, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff,
                          len(tok_meta["tokenizer.ggml.tokens"]), tied_output=tied_output,
                          sliding_window=sliding_window, rope_base=rope_base)
    rng = np.random.default_rng(seed)
    head = "output_norm.weight" if config.tied else "output.weight"
    tensors = {}
    embd = None
    for name, shape in config.tensor_shapes().items():
        if name.endswith(".bias"):
            tensors[name] = (0.5 * rng.standard_normal(shape)).astype(np.float32)
            continue
        if name == "token_embd.weight":
            embd = _draw(rng, shape, embd_scale)
            tensors[name] = _encode(embd, weight_type)
            continue
        post = name.endswith(("post_attention_norm.weight", "post_ffw_norm.weight"))
        router = name.endswith("ffn_gate_inp.weight")  # stays F32, as in quantized files; scaled by `router`
        add = _echo_rows(embd, echo * peak, seed) if name == head and echo and len(shape) == 2 else None
        tensors[name] = _random_weight(rng, shape, QT.F32 if router else weight_type,
                                       scale=peak if name == head else router_scale if router else 1.0, add=add)
        if name == head and len(shape) == 1 or post:
            tensors[name] *= np.float32(peak if name == head else post_norm)
    metadata = config.metadata() | tok_meta
    if longrope:
        if arch != "phi3":
            raise ValueError(f"LongRoPE is phi3's, not {arch}'s")
        _add_longrope(tensors, metadata, head_dim // 2, longrope)
    if rope_freqs:
        if arch != "llama":
            raise ValueError(f"rope_freqs is llama's, not {arch}'s")
        tensors["rope_freqs.weight"] = np.geomspace(1.0, 8.0, head_dim // 2).astype(np.float32)
    if edit is not None:
        edit(tensors)
    metadata |= dict(extra_metadata or {})
    if arch_name is not None:
        metadata = {k.replace(f"{arch}.", f"{arch_name}.", 1): v for k, v in metadata.items()}
    return write_gguf(path, arch_name or arch, metadata, tensors)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """values [..., K] (K a multiple of 256) as Q4_K blocks (uint8 [..., K / 256 * 144]): per 256-value
    super-block an f16 scale d and min dmin, eight 6-bit sub-block scales and mins, and 4-bit quants, so
    that x = d * sc * q - dmin * m. A plain min/max fit (llama.cpp searches better scales): the file only
    has to be valid Q4_K; both runners decode the same bytes."""
    x = np.asarray(values, dtype=np.float32)
    outer, k = x.shape[:-1], x.shape[-1]
    if k % 256:
        raise ValueError(f"Q4_K rows must be multiples of 256 values, got {k}")
    sub = x.reshape(-1, 8, 32)  # [super-blocks, sub-blocks, values]
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - lo) / 15.0
    mins = -lo
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[:, :, None]
    q = np.divide(sub + (dminf * m)[:, :, None], step, out=np.zeros_like(sub), where=step > 0)
    q = np.clip(np.rint(q), 0, 15).astype(np.uint8)
    packed = np.zeros((sub.shape[0], 12), dtype=np.uint8)  # ggml's get_scale_min_k4 layout
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # 64 values per 32 bytes: low then high nibbles
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    return blocks.reshape(*outer, k // 256 * 144)


def _iq4_indices(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per value of x [blocks, 32], the index of IQ4_VALUES nearest x / scale (scale [blocks], 0 gives 0s)."""
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
    return np.abs(x[..., None] * inv[:, None, None] - IQ4_VALUES).argmin(axis=-1).astype(np.uint8)


def _iq4_scale(x: np.ndarray) -> np.ndarray:
    """Per block of x [blocks, 32] the scale that puts its largest value on IQ4_VALUES' -127, then refined once
    by least squares over the indices it gives (ggml searches more scales; any valid block does here)."""
    signed_max = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]
    scale = signed_max / np.float32(-127)
    v = IQ4_VALUES[_iq4_indices(x, scale)]
    vv = (v * v).sum(axis=1)
    return np.divide((v * x).sum(axis=1), vv, out=scale.copy(), where=vv > 0).astype(np.float32)


def _iq4_pack(idx: np.ndarray) -> np.ndarray:
    """Indices [blocks, 32] as 16 bytes per block: element j in the low nibble of byte j, j + 16 in its high one."""
    return idx[:, :16] | (idx[:, 16:] << 4)


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """values [..., K] (K a multiple of 32) as IQ4_NL blocks (uint8 [..., K / 32 * 18]): per 32 values an f16
    scale d and 4-bit indices into IQ4_VALUES, x = d * IQ4_VALUES[q]."""
    x = np.asarray(values, dtype=np.float32)
    blocks = x.reshape(-1, 32)
    d = _iq4_scale(blocks).astype(np.float16)
    qs = _iq4_pack(_iq4_indices(blocks, d.astype(np.float32)))
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1).reshape(*x.shape[:-1], -1)


def quantize_iq4_xs(values: np.ndarray) -> np.ndarray:
    """values [..., K] (K a multiple of 256) as IQ4_XS blocks (uint8 [..., K / 256 * 136]): per 256 values an f16
    scale d, per 32 of them a six-bit scale ls (stored + 32: four low bits in scales_l, two high ones in
    scales_h) and IQ4_NL's 4-bit indices, x = d * (ls - 32) * IQ4_VALUES[q]."""
    x = np.asarray(values, dtype=np.float32)
    sub = x.reshape(-1, 8, 32)
    n = len(sub)
    scales = _iq4_scale(sub.reshape(-1, 32)).reshape(n, 8)
    signed_max = scales[np.arange(n), np.abs(scales).argmax(axis=1)]
    d = (signed_max / np.float32(-32)).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    ls = np.clip(np.rint(np.divide(scales, df, out=np.zeros_like(scales), where=df != 0)), -32, 31).astype(np.int32)
    idx = _iq4_indices(sub.reshape(-1, 32), (df * ls.astype(np.float32)).reshape(-1))
    stored = (ls + 32).astype(np.uint16)
    scales_h = ((stored >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype(np.uint16)
    low = (stored & 15).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), scales_h.view(np.uint8).reshape(-1, 2), scales_l,
                             _iq4_pack(idx).reshape(n, 128)], axis=1)
    return blocks.reshape(*x.shape[:-1], -1)


@dataclass(frozen=True)
class QuantizedTensor:
    """Already-encoded tensor bytes: `raw` is uint8 of shape (*outer, row bytes), `qtype` its format."""

    raw: np.ndarray
    qtype: QT


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def tiny_bpe_vocab(n_vocab: int | None = None,
                   text_padding: bool = False) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of the tiny tokenizer: 256 byte symbols (id = byte value), one token
    per merge, then "<|endoftext|>"; `n_vocab` above that pads with control tokens "<|reserved_N|>", or with
    text_padding, with text tokens (text_tokens)."""
    byte_map = bytes_to_unicode()
    tokens = [byte_map[b] for b in range(256)] + [m.replace(" ", "") for m in TINY_MERGES] + [EOT]
    types = [TOKEN_NORMAL] * (len(tokens) - 1) + [TOKEN_CONTROL]
    n_vocab = len(tokens) if n_vocab is None else n_vocab
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab must be at least {len(tokens)} for the tiny tokenizer, got {n_vocab}")
    n_pad = n_vocab - len(tokens)
    if text_padding:
        tokens += text_tokens(tokens, n_pad)
        types += [TOKEN_NORMAL] * n_pad
    else:
        tokens += [f"<|reserved_{i}|>" for i in range(n_pad)]
        types += [TOKEN_CONTROL] * n_pad
    return tokens, list(TINY_MERGES), types


def text_tokens(vocab: list[str], n: int) -> list[str]:
    """n normal tokens that read as words (" w0", " w1", ... in GPT-2's byte symbols, skipping texts `vocab`
    has): padding that a random model's picks detokenize to text, in ggrun and llama.cpp alike, where control
    tokens ("<|reserved_N|>") render as nothing and a server streams no text at all. No merge makes them, so
    they never appear in a tokenized prompt."""
    taken = set(vocab)
    words = (f"\u0120w{i}" for i in range(len(vocab) + n + 1))
    return [w for w in words if w not in taken][:n]


def tokenizer_metadata(n_vocab: int | None = None, text_padding: bool = False) -> dict[str, Any]:
    """The tokenizer.ggml.* keys of a gpt2-style byte-level BPE tokenizer, as llama.cpp writes them."""
    tokens, merges, types = tiny_bpe_vocab(n_vocab, text_padding)
    eot = tokens.index(EOT)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": eot,
        "tokenizer.ggml.eos_token_id": eot,
        "tokenizer.ggml.add_bos_token": False,
    }


def tokenizer_from_file(path: str | os.PathLike[str], n_vocab: int) -> dict[str, Any]:
    """Another GGUF's tokenizer.* keys (vocabulary, merges, special ids, flags, chat template) with their
    stored types, its vocabulary padded to `n_vocab` with text tokens (text_tokens) when it has fewer: a real
    tokenizer for a model of random weights. Padding is for byte-level BPE vocabularies (gpt2) only."""
    fields = GGUFReader(path).fields
    md = {key: _stored_value(field) for key, field in fields.items() if key.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in md:
        raise ValueError(f"{path} has no tokenizer (no tokenizer.ggml.tokens)")
    tokens = md["tokenizer.ggml.tokens"]
    n_pad = n_vocab - len(tokens)
    if n_pad <= 0:
        return md
    if md.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{path}'s {md.get('tokenizer.ggml.model')} tokenizer has {len(tokens)} tokens, not "
                         f"{n_vocab}: padding is written for byte-level BPE (gpt2) vocabularies only")
    md["tokenizer.ggml.tokens"] = tokens + text_tokens(tokens, n_pad)
    pads = {"tokenizer.ggml.token_type": TOKEN_NORMAL, "tokenizer.ggml.scores": 0.0}
    for key, pad in pads.items():
        if key in md:
            md[key] = np.concatenate([md[key], np.full(n_pad, pad, md[key].dtype)])
    return md


def _stored_value(field: ReaderField) -> Any:
    """A GGUFReader field's value as write_gguf stores it again with the same type: numpy scalars and arrays
    of the stored width, strings and lists of strings as they are."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        item = field.types[-1]
        if item == GGUFValueType.STRING:
            return list(field.contents())
        return np.array(field.contents(), dtype=_VALUE_DTYPES[item])
    if vtype in (GGUFValueType.STRING, GGUFValueType.BOOL):
        return field.contents()
    return _VALUE_DTYPES[vtype].type(field.contents())


def write_gguf(path: str | os.PathLike[str], arch: str, metadata: Mapping[str, Any],
               tensors: Mapping[str, np.ndarray | QuantizedTensor]) -> Path:
    """Write a GGUF file. Float arrays are stored as F32/F16 by dtype; QuantizedTensor as its bytes.

    Metadata value types: numpy scalars and arrays keep their width; bool -> BOOL, int -> UINT32
    (INT32 if negative), float -> FLOAT32, str -> STRING, lists -> ARRAY of their first item's type.
    """
    path = Path(path)
    writer = _writer_with_metadata(arch, metadata)
    for name, tensor in tensors.items():
        if isinstance(tensor, QuantizedTensor):
            writer.add_tensor(name, tensor.raw, raw_dtype=tensor.qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(tensor))
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf_sparse(path: str | os.PathLike[str], arch: str, metadata: Mapping[str, Any],
                      shapes: Mapping[str, tuple[tuple[int, ...], QT]]) -> Path:
    """Write a GGUF file whose tensor data section is all zeros and sparse: the header is written,
    then the file is extended with truncate, so a multi-GB model takes a few KB of disk."""
    path = Path(path)
    writer = _writer_with_metadata(arch, metadata)
    data_bytes = 0
    for name, (shape, qtype) in shapes.items():
        nbytes = _nbytes(qtype, shape)
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        data_bytes += GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    header_bytes = GGUFWriter.ggml_pad(writer.fout[0].tell(), writer.data_alignment)
    writer.close()
    os.truncate(path, header_bytes + data_bytes)
    return path


def write_tiny_llama(path: str | os.PathLike[str], *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                     n_head_kv: int = 2, n_ff: int = 128, n_vocab: int | None = None, n_ctx_train: int = 256,
                     rope_base: float = 10000.0, tied_output: bool = False, weight_type: QT = QT.F32,
                     seed: int = 0, extra_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a small llama model with random weights and the tiny BPE tokenizer.

    Matrices are drawn from N(0, 1/fan_in) (so activations and logits stay near unit scale) and
    stored in `weight_type`; norm weights are near 1 and always F32, as llama.cpp stores them.
    `n_vocab` defaults to the tokenizer's size. `extra_metadata` adds or overrides keys.
    """
    weight_type = QT(weight_type)
    if weight_type not in WEIGHT_TYPES:
        names = ", ".join(sorted(t.name for t in WEIGHT_TYPES))
        raise ValueError(f"weight_type {weight_type.name} is not one gguf can quantize ({names})")
    tok_meta = tokenizer_metadata(n_vocab)
    config = LlamaConfig(n_layer, n_embd, n_head, n_head_kv, n_ff, len(tok_meta["tokenizer.ggml.tokens"]),
                         n_ctx_train, rope_base, tied_output=tied_output)
    rng = np.random.default_rng(seed)
    tensors = {name: _random_weight(rng, shape, weight_type) for name, shape in config.tensor_shapes().items()}
    metadata = config.metadata() | tok_meta | dict(extra_metadata or {})
    return write_gguf(path, "llama", metadata, tensors)


def write_tiny_gemma3(path: str | os.PathLike[str], *, n_layer: int = 7, n_embd: int = 64, n_head: int = 4,
                      n_head_kv: int = 1, head_dim: int = 32, n_ff: int = 128, n_vocab: int | None = None,
                      n_ctx_train: int = 256, sliding_window: int = 8, rope_base: float = 1_000_000.0,
                      weight_type: QT = QT.F32, seed: int = 0,
                      extra_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a small gemma3 model with random weights and the tiny BPE tokenizer (any tokenizer serves
    the architecture). The defaults give 7 layers, so both kinds appear: 0-4 and 6 sliding-window,
    5 global; head_dim 32 differs from n_embd / n_head on purpose.

    Weights are drawn as in write_tiny_llama: matrices N(0, 1/fan_in) in `weight_type`, norm weights
    (stored as used, like llama.cpp's converter writes them: 1 already added) near 1 in F32.
    """
    weight_type = QT(weight_type)
    if weight_type not in WEIGHT_TYPES:
        names = ", ".join(sorted(t.name for t in WEIGHT_TYPES))
        raise ValueError(f"weight_type {weight_type.name} is not one gguf can quantize ({names})")
    tok_meta = tokenizer_metadata(n_vocab)
    config = Gemma3Config(n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, len(tok_meta["tokenizer.ggml.tokens"]),
                          n_ctx_train, sliding_window, rope_base)
    rng = np.random.default_rng(seed)
    tensors = {name: _random_weight(rng, shape, weight_type) for name, shape in config.tensor_shapes().items()}
    metadata = config.metadata() | tok_meta | dict(extra_metadata or {})
    return write_gguf(path, "gemma3", metadata, tensors)


def write_sparse_big(path: str | os.PathLike[str], *, n_layer: int = 32, n_embd: int = 4096, n_head: int = 32,
                     n_head_kv: int = 8, n_ff: int = 14336, n_vocab: int = 32000, n_ctx_train: int = 8192,
                     weight_type: QT = QT.Q4_K, tied_output: bool = False) -> Path:
    """Write a llama model of real size (default: Llama-3-8B's shape with a 32k vocabulary, ~4 GB of
    Q4_K data) whose weights are sparse zeros: valid metadata and tensor directory, a few KB on disk."""
    tok_meta = tokenizer_metadata(n_vocab)
    config = LlamaConfig(n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, n_ctx_train,
                         rope_base=500000.0, tied_output=tied_output)
    shapes = {name: (shape, QT.F32 if len(shape) == 1 else QT(weight_type))
              for name, shape in config.tensor_shapes().items()}
    return write_gguf_sparse(path, "llama", config.metadata() | tok_meta, shapes)


@dataclass(frozen=True)
class SpeedPreset:
    """A real model's shape for speed measurements (write_synthetic): its family's hyperparameters, and
    `dense_type`, the type its non-expert matrices ship in when they differ from the experts' (gpt-oss: Q8_0
    beside MXFP4 experts; None: the written type throughout)."""

    config: FamilyConfig
    dense_type: QT | None = None


def _llama_shape(n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_vocab: int) -> SpeedPreset:
    """A llama preset as llama.cpp's make_synthetic presets give them (head n_embd / n_head, RoPE base 500000)."""
    return SpeedPreset(FamilyConfig("llama", n_layer, n_embd, n_head, n_head_kv, n_embd // n_head, n_ff, n_vocab,
                                    n_ctx_train=8192, rope_base=500000.0, rms_eps=1e-5, tied_output=True))


# Real models' shapes for speed measurements: llama.cpp's make_synthetic presets (llama-70b added), Qwen3-0.6B,
# Qwen3-30B-A3B (128 experts, 8 used) and gpt-oss-20b (32 experts, 4 used, window 128 on alternate layers), and
# the first layers of the last two (-12l, -6l: for the CPU);
# heads are tied to the embedding (the product is the same size as an output matrix's) but gpt-oss's, which
# llama.cpp requires as a tensor of its own.
SPEED_PRESETS: dict[str, SpeedPreset] = {
    "llama-135m": _llama_shape(30, 576, 9, 3, 1536, 49152),
    "llama-1b": _llama_shape(16, 2048, 32, 8, 8192, 128256),
    "llama-3b": _llama_shape(28, 3072, 24, 8, 8192, 128256),
    "llama-8b": _llama_shape(32, 4096, 32, 8, 14336, 128256),
    "llama-70b": _llama_shape(80, 8192, 64, 8, 28672, 128256),
    "qwen3-0.6b": SpeedPreset(FamilyConfig("qwen3", 28, 1024, 16, 8, 128, 3072, 151936, n_ctx_train=40960,
                                           rope_base=1_000_000.0, tied_output=True)),
    "qwen3-30b-a3b": SpeedPreset(FamilyConfig("qwen3moe", 48, 2048, 32, 4, 128, 6144, 151936, n_ctx_train=40960,
                                              rope_base=1_000_000.0, tied_output=True, n_expert=128,
                                              n_expert_used=8, n_ff_exp=768)),
    "gpt-oss-20b": SpeedPreset(FamilyConfig("gpt-oss", 24, 2880, 64, 8, 64, 2880, 201088, n_ctx_train=131072,
                                            rope_base=150000.0, rms_eps=1e-5, sliding_window=128,
                                            n_expert=32, n_expert_used=4, n_ff_exp=2880), dense_type=QT.Q8_0),
}


def _first_layers(preset: str, n_layer: int) -> SpeedPreset:
    """A preset's first n_layer layers (its head and embedding whole): the layers' speed on a machine whose
    memory does not hold the whole model (the CPU keeps a repacked copy of a model's matrices in memory beside the
    mapped file)."""
    spec = SPEED_PRESETS[preset]
    return replace(spec, config=replace(spec.config, n_layer=n_layer))


SPEED_PRESETS["qwen3-30b-a3b-12l"] = _first_layers("qwen3-30b-a3b", 12)
SPEED_PRESETS["gpt-oss-20b-6l"] = _first_layers("gpt-oss-20b", 6)
BLOCK_SCALE = 0.002  # Q4_0's f16 scale: products of random quants stay finite over 80 layers


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


# Per block type, the bytes written over each random block's scale fields (offset, bytes), chosen so that its
# values stay within about Q4_0's at BLOCK_SCALE (|x| <~ 0.02): Q4_K's d and dmin (dmin * 7.5 d centres the
# sub-blocks' mins near their quants' mean), IQ4_XS's d (times six-bit scales up to 32 and values up to 127),
# MXFP4's E8M0 exponent (2^(118 - 128) times values up to 12).
RANDOM_BLOCK_SCALES: dict[QT, tuple[tuple[int, bytes], ...]] = {
    QT.Q4_0: ((0, _f16(BLOCK_SCALE)),),
    QT.Q8_0: ((0, _f16(BLOCK_SCALE / 16)),),
    QT.Q4_K: ((0, _f16(BLOCK_SCALE / 32)), (2, _f16(BLOCK_SCALE / 32 * 7.5))),
    QT.IQ4_NL: ((0, _f16(BLOCK_SCALE / 16)),),
    QT.IQ4_XS: ((0, _f16(BLOCK_SCALE / 1024)),),
    QT.MXFP4: ((0, bytes([118])),),
}
RANDOM_BLOCK_TYPES = (*RANDOM_BLOCK_SCALES, QT.F16)


def write_synthetic(path: str | os.PathLike[str], preset: str, weight_type: QT = QT.Q4_0, seed: int = 0,
                    tokenizer_from: str | os.PathLike[str] | None = None) -> Path:
    """A model of a real model's shape (SPEED_PRESETS) whose matrices are random blocks with small scales (as
    llama.cpp's make_synthetic.py fills them; for speed measurements only), the head as the preset says,
    and a tokenizer: the tiny one, or `tokenizer_from`'s (another GGUF's, chat template and all), padded to
    the preset's vocabulary with text tokens, so that what the random weights pick streams as text (a
    server's time to first token needs some); a larger tokenizer's vocabulary replaces the preset's.
    Tensors are drawn and written one at a time, so a 70B model (about 75 GB in Q8_0) never has to fit in
    memory; it takes minutes, mostly the disk's."""
    spec = SPEED_PRESETS[preset]
    qtype = QT(weight_type)
    if qtype not in RANDOM_BLOCK_TYPES:
        raise ValueError(f"{qtype.name}: random blocks are written for {[t.name for t in RANDOM_BLOCK_TYPES]}")
    n_vocab = spec.config.n_vocab
    tok_meta = (tokenizer_metadata(n_vocab, text_padding=True) if tokenizer_from is None
                else tokenizer_from_file(tokenizer_from, n_vocab))
    config = replace(spec.config, n_vocab=len(tok_meta["tokenizer.ggml.tokens"]))
    shapes = {name: (shape, _speed_type(spec, name, shape, qtype)) for name, shape in config.tensor_shapes().items()}
    for name, (shape, t) in shapes.items():
        if shape[-1] % GGML_QUANT_SIZES[t][0]:
            raise ValueError(f"{preset} in {qtype.name}: {name}'s rows of {shape[-1]} are not whole {t.name} blocks")
    writer = _writer_with_metadata(config.arch, config.metadata() | tok_meta
                                   | {"general.name": f"synthetic {preset} {qtype.name}"})
    for name, (shape, t) in shapes.items():
        writer.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(t, shape), raw_dtype=t)
    path = Path(path)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, (shape, t) in shapes.items():
        writer.write_tensor_data(_random_blocks(rng, name, shape, t))
    writer.close()
    return path


def _speed_type(spec: SpeedPreset, name: str, shape: tuple[int, ...], qtype: QT) -> QT:
    """The type write_synthetic stores a tensor in: norms, biases, sinks and routers F32 (as quantized files
    keep them), experts in `qtype`, other matrices in the preset's dense_type if it has one, else `qtype`."""
    if len(shape) == 1 or name.endswith((".bias", "ffn_gate_inp.weight")):
        return QT.F32
    if "_exps." in name or spec.dense_type is None:
        return qtype
    return spec.dense_type


def _random_blocks(rng: np.random.Generator, name: str, shape: tuple[int, ...], qtype: QT) -> np.ndarray:
    """A tensor's bytes: norms and sinks of ones, biases of zeros, routers (F32 matrices) of N(0, 0.02), so that
    tokens spread over the experts; f16 values of N(0, 0.02); block types as random quants behind small scales
    (RANDOM_BLOCK_SCALES)."""
    if qtype == QT.F32:
        if name.endswith(".bias"):
            return np.zeros(shape, np.float32)
        return np.ones(shape, np.float32) if len(shape) == 1 else rng.standard_normal(shape, np.float32) * 0.02
    if qtype == QT.F16:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape, dtype=np.int64)) // block_size
    raw = np.frombuffer(rng.bytes(n_blocks * type_size), np.uint8).reshape(n_blocks, type_size).copy()
    for offset, value in RANDOM_BLOCK_SCALES[qtype]:
        raw[:, offset:offset + len(value)] = np.frombuffer(value, np.uint8)
    return raw


def write_variant(path: str | os.PathLike[str], config: LlamaConfig | Gemma3Config, *,
                  meta: Mapping[str, Any] | None = None,
                  edit: Callable[[dict[str, np.ndarray]], None] | None = None, seed: int = 0) -> Path:
    """A model of `config` with random F32 weights (drawn as write_tiny_llama draws them) and the tiny
    tokenizer, changed on purpose: `meta` overrides metadata keys (None removes a key), and `edit` changes
    the dict of tensors in place (retype, reshape, drop or poison one) before it is written."""
    arch = "gemma3" if isinstance(config, Gemma3Config) else "llama"
    rng = np.random.default_rng(seed)
    tensors = {name: _random_weight(rng, shape, QT.F32) for name, shape in config.tensor_shapes().items()}
    if edit is not None:
        edit(tensors)
    metadata = config.metadata() | tokenizer_metadata(config.n_vocab)
    for key, value in (meta or {}).items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    return write_gguf(path, arch, metadata, tensors)


def _random_weight(rng: np.random.Generator, shape: tuple[int, ...], qtype: QT,
                   scale: float = 1.0, add: np.ndarray | None = None) -> np.ndarray | QuantizedTensor:
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    values = _draw(rng, shape, scale)
    return _encode(values if add is None else values + add.astype(np.float32), qtype)


def _draw(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """A matrix's f32 values N(0, scale^2 / fan_in)."""
    values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return values * np.float32(scale) if scale != 1.0 else values


def _encode(values: np.ndarray, qtype: QT) -> np.ndarray | QuantizedTensor:
    """f32 values stored as `qtype` (F32, F16 or a block type the writer encodes)."""
    if qtype == QT.F32:
        return values
    if qtype == QT.F16:
        return values.astype(np.float16)
    encoders = {QT.Q4_K: quantize_q4_k, QT.IQ4_NL: quantize_iq4_nl, QT.IQ4_XS: quantize_iq4_xs}
    if qtype in encoders:
        return QuantizedTensor(encoders[qtype](values), qtype)
    return QuantizedTensor(quantize(values, qtype), qtype)


def _nbytes(qtype: QT, shape: tuple[int, ...]) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


def _writer_with_metadata(arch: str, metadata: Mapping[str, Any]) -> GGUFWriter:
    writer = GGUFWriter(None, arch)
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        vtype, sub_type, value = _typed(value)
        writer.add_key_value(key, value, vtype, sub_type)
    return writer


def _typed(value: Any) -> tuple[GGUFValueType, GGUFValueType | None, Any]:
    """(value type, array item type, value as GGUFWriter packs it) for one metadata value."""
    if isinstance(value, np.ndarray):
        return GGUFValueType.ARRAY, _NUMPY_VALUE_TYPES[value.dtype], value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("GGUF metadata arrays cannot be empty")
        items = [_typed(v) for v in value]
        item_types = {t for t, _, _ in items}
        item_type = GGUFValueType.INT32 if item_types == {GGUFValueType.UINT32, GGUFValueType.INT32} else items[0][0]
        return GGUFValueType.ARRAY, item_type, [v for _, _, v in items]
    if isinstance(value, np.generic):
        return _NUMPY_VALUE_TYPES[value.dtype], None, value.item()
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None, value
    if isinstance(value, int):
        return (GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32), None, value
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None, value
    if isinstance(value, str):
        return GGUFValueType.STRING, None, value
    raise TypeError(f"cannot store {type(value).__name__} as GGUF metadata")


def written_once(write, make_dir, prefix: str):
    """write(**options) -> path, writing each distinct set of options once into a folder make_dir(prefix)
    gives (a pytest fixture passes tmp_path_factory.mktemp)."""
    written: dict[tuple, Path] = {}

    def once(**options) -> Path:
        key = tuple(sorted(options.items()))
        if key not in written:
            name = prefix + "-" + "-".join(f"{k}={getattr(v, 'name', v)}" for k, v in key) + ".gguf"
            written[key] = write(make_dir(prefix) / name, **options)
        return written[key]

    return once


def main(argv: list[str] | None = None) -> None:
    """python -m ggrun.loaders.synthetic OUT.gguf PRESET TYPE [--tokenizer-from GGUF]: write_synthetic's model
    of a real shape, printing its path."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ggrun.loaders.synthetic", description=main.__doc__.split(":")[0])
    ap.add_argument("out")
    ap.add_argument("preset", choices=sorted(SPEED_PRESETS))
    ap.add_argument("type", type=str.upper, choices=[t.name for t in RANDOM_BLOCK_TYPES])
    ap.add_argument("--tokenizer-from", help="a GGUF whose tokenizer (and chat template) the model takes")
    a = ap.parse_args(argv)
    print(write_synthetic(a.out, a.preset, QT[a.type], tokenizer_from=a.tokenizer_from))


if __name__ == "__main__":
    main()
