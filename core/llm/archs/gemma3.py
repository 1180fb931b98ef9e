"""The gemma3 architecture: scaled embeddings, RMS norms before and after attention and
feed-forward, per-head RMS norms on q and k, RoPE in neox mode with a local base on
sliding-window layers (5 of every 6) and a global base on the rest, GeGLU feed-forward,
tied output head."""
from __future__ import annotations

import math
from dataclasses import replace

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
ROPE_MODE = ops.ROPE_NEOX
SWA_PATTERN = 6  # layers il with il % 6 < 5 attend within the sliding window
ROPE_BASE_SWA = 10000.0


def hparams(gf) -> HParams:
    n_vocab = len(gf.get("tokenizer.ggml.tokens") or []) or gf.require_tensor("token_embd.weight").shape[0]
    hp = HParams.from_metadata(gf.get, str(gf.path), n_vocab)
    extra = {"swa_window": int(gf.get("gemma3.attention.sliding_window", 0)) or None,
             "attn_scale": 1.0 / math.sqrt(hp.head_dim)}
    return replace(hp, extra=extra)


def is_swa(hp: HParams, il: int) -> bool:
    return hp.extra.get("swa_window") is not None and il % SWA_PATTERN < SWA_PATTERN - 1


def swa_layers(hp: HParams) -> list[bool]:
    """Which layers attend within the sliding window (they get the window-sized cache)."""
    return [is_swa(hp, il) for il in range(hp.n_layer)]


def rope_freq_base_of(hp: HParams):
    """Per-layer RoPE base: the local base on sliding-window layers (used by the K-shift too)."""
    return lambda il: ROPE_BASE_SWA if is_swa(hp, il) else hp.rope_freq_base


def build(b: Build, w: Weights) -> Tensor:
    """Logits [n_outputs, n_vocab] of the micro-batch in b.inp."""
    hp = b.hp
    x = blocks.embed(b, w)
    x = ops.scale(x, math.sqrt(hp.n_embd), name="inp_scaled")
    base_of = rope_freq_base_of(hp)
    ffn = None  # the previous layer's feed-forward output, normalised and added with the next norm
    for il in range(hp.n_layer):
        L = w.layer(il)
        post = w.layer(il - 1).post_ffw_norm if il else None
        x, h = blocks.add_norm(b, x, ffn, L.attn_norm, f"attn_norm-{il}", stream=f"l_out-{il - 1}", post=post)
        q, k, v = blocks.project_qkv(b, h, L.attn_q, L.attn_k, L.attn_v, il)
        q = blocks.rope(b, q, ROPE_MODE, base_of(il), out_scale=hp.extra["attn_scale"], norm=L.attn_q_norm,
                        name=f"q_scaled-{il}")  # q_norm, RoPE and the query scale in one node
        mask = b.inp.kq_mask_swa.tensor if is_swa(hp, il) else None
        attn = blocks.attention(b, il, q, k, v, L.attn_output, ROPE_MODE, base_of(il), kq_scale=1.0, mask=mask,
                                k_norm=L.attn_k_norm)
        if il == hp.n_layer - 1:
            attn, x = blocks.select_outputs(b, attn, x)
        x, h = blocks.add_norm(b, x, attn, L.ffn_norm, f"ffn_norm-{il}", stream=f"sa_out-{il}",
                               post=L.post_attention_norm)
        ffn = blocks.ffn_geglu(b, h, L.ffn_gate, L.ffn_up, L.ffn_down, il)
    x, h = blocks.add_norm(b, x, ffn, w["output_norm.weight"], "result_norm", stream=f"l_out-{hp.n_layer - 1}",
                           post=w.layer(hp.n_layer - 1).post_ffw_norm)
    return ops.mul_mat(w["output.weight"], h, name="result_output")
