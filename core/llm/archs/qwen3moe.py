"""The qwen3moe architecture (Qwen3-30B-A3B and kin): qwen3's attention (QK-norm, RoPE in neox mode) with a
mixture of SwiGLU experts for a feed-forward: each token goes to expert_used_count of expert_count experts
by the router's softmax, their outputs weighted by the renormalised probabilities (blocks.ffn_moe)."""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.errors import BadInput
from ggrun.core.llm import blocks
from ggrun.core.llm.archs import base
from ggrun.core.llm.archs.base import Arch, TensorSpec
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.checks import Key, MAX_COUNT, MAX_WIDTH
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor


def _n_exp(hp: HParams) -> int:
    return hp.extra["n_expert"]


def _ff_exp(hp: HParams) -> int:
    return hp.extra["n_ff_exp"] or hp.n_ff // hp.extra["n_expert_used"]


EXPERTS = (
    TensorSpec("ffn_gate_inp.weight", "[expert_count, n_embd]", lambda hp: (_n_exp(hp), hp.n_embd)),
    TensorSpec("ffn_gate_exps.weight", "[expert_count, n_ff_exp, n_embd]",
               lambda hp: (_n_exp(hp), _ff_exp(hp), hp.n_embd)),
    TensorSpec("ffn_up_exps.weight", "[expert_count, n_ff_exp, n_embd]",
               lambda hp: (_n_exp(hp), _ff_exp(hp), hp.n_embd)),
    TensorSpec("ffn_down_exps.weight", "[expert_count, n_embd, n_ff_exp]",
               lambda hp: (_n_exp(hp), hp.n_embd, _ff_exp(hp))),
)


class Qwen3Moe(Arch):
    name = "qwen3moe"
    rope_mode = ops.ROPE_NEOX
    keys = (Key("expert_count", int, 1, MAX_COUNT, required=True, extra="n_expert"),
            Key("expert_used_count", int, 1, MAX_COUNT, required=True, extra="n_expert_used"),
            Key("expert_feed_forward_length", int, 1, MAX_WIDTH, default=0, extra="n_ff_exp"))
    layer_tensors = (base.ATTN_NORM, base.ATTN_Q, base.ATTN_K, base.ATTN_V, base.ATTN_OUT, base.ATTN_Q_NORM,
                     base.ATTN_K_NORM, base.FFN_NORM) + base.QKV_BIASES + EXPERTS

    def hparams(self, gf) -> HParams:
        hp = super().hparams(gf)
        if hp.extra["n_expert_used"] > hp.extra["n_expert"]:
            raise BadInput(f"{gf.path}: qwen3moe.expert_used_count = {hp.extra['n_expert_used']}, expected at most "
                           f"qwen3moe.expert_count ({hp.extra['n_expert']})")
        return hp

    def build(self, b: Build, w: Weights) -> Tensor:
        n_used = b.hp.extra["n_expert_used"]
        h = blocks.decoder(b, w, lambda L, x, il: blocks.self_attention(b, L, x, il, self.rope_mode, qk_norm=True),
                           lambda L, x, il: blocks.ffn_moe(x, L, il, n_used))
        return blocks.head(b, w, h)
