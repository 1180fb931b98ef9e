"""The phi3 architecture (Phi-3, Phi-4): llama's stack with RoPE in neox mode, queries scaled by
1/sqrt(head_dim) before attention, and matrices stored fused: attn_qkv holds the query, key and value
rows one after another, ffn_up the gate's rows then the up's. The runtime loads each as its parts (rows
of the stored bytes), so the graph is llama's over attn_q/k/v and ffn_gate/up.

LongRoPE (Phi-3-128k, Phi-3.5): rope_factors_long and rope_factors_short (f32 [n_rot / 2]) divide each pair's
RoPE angle, the long ones where a session's cache holds more cells than rope.scaling.original_context_length
(the context trained on first), else the short ones, and rope.scaling.attn_factor scales cos and sin, as
llama.cpp's get_rope_factors and ggml_rope_ext do."""
from __future__ import annotations

import math

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.archs import base
from ggrun.core.llm.archs.base import Arch, TensorSpec, check_rope_factors
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.checks import Key, MAX_CONTEXT
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor

FFN_UP_FUSED = TensorSpec("ffn_up.weight", "[2 * n_ff, n_embd]", lambda hp: (2 * hp.n_ff, hp.n_embd))
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class Phi3(Arch):
    name = "phi3"
    rope_mode = ops.ROPE_NEOX
    keys = (Key("rope.scaling.original_context_length", int, 1, MAX_CONTEXT, default=0, extra="n_ctx_orig"),
            Key("rope.scaling.attn_factor", float, 0.0, 1e6, lo_open=True, default=1.0, extra="rope_attn_factor"))
    layer_tensors = (base.ATTN_NORM, base.ATTN_QKV.optional(), base.ATTN_Q.optional(), base.ATTN_K.optional(),
                     base.ATTN_V.optional(), base.ATTN_OUT, base.FFN_NORM, FFN_UP_FUSED, base.FFN_DOWN,
                     base.ATTN_QKV_BIAS) + base.QKV_BIASES

    def hparams(self, gf) -> HParams:
        """With LongRoPE's factors, each f32 [n_rot / 2], and the attention factor as a RoPE scale (ops.Yarn
        without its ramp: ggml's mscale)."""
        hp = super().hparams(gf)
        if check_rope_factors(gf, hp, ROPE_FACTORS):
            hp.extra["yarn"] = ops.Yarn(0.0, hp.extra["rope_attn_factor"], 32.0, 1.0,
                                        hp.extra["n_ctx_orig"] or hp.n_ctx_train)
        return hp

    def rope_factors(self, w: Weights, hp: HParams, n_ctx: int) -> Tensor | None:
        """The long factors past the original context (n_ctx_orig, else the trained one), else the short ones."""
        long = n_ctx > (hp.extra["n_ctx_orig"] or hp.n_ctx_train)
        return w.get(ROPE_FACTORS[0] if long else ROPE_FACTORS[1])

    def required_tensors(self, hp: HParams) -> list[tuple[str, ...]]:
        """q/k/v fused in attn_qkv or apart; the rest as the table says."""
        apart = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
        return [("attn_qkv.weight", name) for name in apart] + super().required_tensors(hp)

    def fused(self, hp: HParams, name: str) -> list[tuple[str, int]]:
        if name in ("attn_qkv.weight", "attn_qkv.bias"):
            kind = name.split(".")[1]
            return [(f"attn_q.{kind}", hp.n_head * hp.head_dim), (f"attn_k.{kind}", hp.n_embd_kv),
                    (f"attn_v.{kind}", hp.n_embd_kv)]
        if name == "ffn_up.weight":
            return [("ffn_gate.weight", hp.n_ff), ("ffn_up.weight", hp.n_ff)]
        return []

    def build(self, b: Build, w: Weights) -> Tensor:
        q_scale = 1.0 / math.sqrt(b.hp.head_dim)
        h = blocks.decoder(b, w, lambda L, x, il: blocks.self_attention(b, L, x, il, self.rope_mode, q_scale=q_scale,
                                                                        kq_scale=1.0),
                           lambda L, x, il: blocks.ffn_swiglu(x, L.ffn_gate, L.ffn_up, L.ffn_down, il))
        return blocks.head(b, w, h)
