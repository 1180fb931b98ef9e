"""The gpt-oss architecture (OpenAI's gpt-oss-20b and -120b; llama.cpp's openai-moe): attention with q/k/v and
output biases and a learned sink logit per head, RoPE in neox mode with YaRN's context extension, every other
layer (the even ones) attending within a sliding window, and for a feed-forward a mixture of experts with
biases whose router's chosen logits are softmaxed into the weights and whose gated unit is swiglu_oai
(clamped at 7, sigmoid slope 1.702, up + 1). The norm before the experts is post_attention_norm."""
from __future__ import annotations

import numpy as np

from ggrun.core import ops
from ggrun.core.errors import BadInput
from ggrun.core.llm import blocks
from ggrun.core.llm.archs import base
from ggrun.core.llm.archs.base import Arch, TensorSpec
from ggrun.core.llm.archs.qwen3moe import EXPERTS
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.checks import Key, MAX_CONTEXT, MAX_COUNT, MAX_WIDTH
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor

SWA_PATTERN = 2  # layers il with il % 2 < 1 attend within the sliding window (llama.cpp's load_swa_pattern(2))
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's defaults (llama-hparams.h)


def _n_exp(hp: HParams) -> int:
    return hp.extra["n_expert"]


def _ff_exp(hp: HParams) -> int:
    return hp.extra["n_ff_exp"]


ATTN_OUT_BIAS = TensorSpec("attn_output.bias", "[n_embd]", lambda hp: (hp.n_embd,))
ATTN_SINKS = TensorSpec("attn_sinks.weight", "[n_head]", lambda hp: (hp.n_head,))
EXPERT_BIASES = (
    TensorSpec("ffn_gate_inp.bias", "[expert_count]", lambda hp: (_n_exp(hp),)),
    TensorSpec("ffn_gate_exps.bias", "[expert_count, n_ff_exp]", lambda hp: (_n_exp(hp), _ff_exp(hp))),
    TensorSpec("ffn_up_exps.bias", "[expert_count, n_ff_exp]", lambda hp: (_n_exp(hp), _ff_exp(hp))),
    TensorSpec("ffn_down_exps.bias", "[expert_count, n_embd]", lambda hp: (_n_exp(hp), hp.n_embd)),
)


def yarn_attn_factor(factor: float) -> float:
    """llama.cpp's yarn_attn_factor for a YaRN factor (llama_context: get_mscale(factor, 1), cancelled by
    1 / (1 + 0.1 ln factor)), in its float32 arithmetic."""
    f = np.float32(factor)
    log = np.float32(np.log(f))
    mscale = np.float32(0.1) * log + np.float32(1) if f > 1 else np.float32(1)
    return float(mscale * (np.float32(1) / (np.float32(1) + np.float32(0.1) * log)))


class GptOss(Arch):
    name = "gpt-oss"
    rope_mode = ops.ROPE_NEOX
    keys = (Key("expert_count", int, 1, MAX_COUNT, required=True, extra="n_expert"),
            Key("expert_used_count", int, 1, MAX_COUNT, required=True, extra="n_expert_used"),
            Key("expert_feed_forward_length", int, 1, MAX_WIDTH, required=True, extra="n_ff_exp"),
            Key("attention.sliding_window", int, 1, MAX_CONTEXT, required=True, extra="swa_window"),
            Key("rope.scaling.original_context_length", int, 1, MAX_CONTEXT, default=0, extra="n_ctx_orig"),
            Key("rope.scaling.attn_factor", float, 0.0, 1e6, lo_open=True, default=1.0, extra="rope_attn_factor"))
    swa_pattern = SWA_PATTERN
    layer_tensors = (base.ATTN_NORM, base.ATTN_Q, base.ATTN_K, base.ATTN_V, base.ATTN_OUT, ATTN_OUT_BIAS,
                     ATTN_SINKS, base.POST_ATTN_NORM) + base.QKV_BIASES + EXPERTS + EXPERT_BIASES

    def hparams(self, gf) -> HParams:
        hp = super().hparams(gf)
        if hp.extra["n_expert_used"] > hp.extra["n_expert"]:
            raise BadInput(f"{gf.path}: gpt-oss.expert_used_count = {hp.extra['n_expert_used']}, expected at most "
                           f"gpt-oss.expert_count ({hp.extra['n_expert']})")
        scaling = gf.get(f"{self.name}.rope.scaling.type")
        if scaling == "yarn":
            attn_factor = float(np.float32(yarn_attn_factor(1.0 / hp.rope_freq_scale)) *
                                np.float32(hp.extra["rope_attn_factor"]))
            hp.extra["yarn"] = ops.Yarn(1.0, attn_factor, YARN_BETA_FAST, YARN_BETA_SLOW,
                                        hp.extra["n_ctx_orig"] or hp.n_ctx_train)
        elif scaling not in (None, "none"):
            raise BadInput(f"{gf.path}: {self.name}.rope.scaling.type = {scaling!r}, expected 'yarn' or none")
        return hp

    def build(self, b: Build, w: Weights) -> Tensor:
        hp = b.hp
        swa = self.swa_layers(hp)
        n_used = hp.extra["n_expert_used"]

        def attn(L, x, il):
            return blocks.self_attention(b, L, x, il, self.rope_mode, mask=b.inp.kq_mask_swa.tensor if swa[il] else None,
                                         sinks=L.attn_sinks)

        def glu(gate: Tensor, up: Tensor, name: str) -> Tensor:
            return ops.swiglu_oai(gate, up, SWIGLU_ALPHA, SWIGLU_LIMIT, name=name)

        def ffn(L, x, il):
            return blocks.ffn_moe(x, L, il, n_used, norm_weights=False, softmax_weights=True, glu=glu)

        h = blocks.decoder(b, w, attn, ffn, ffn_norm="post_attention_norm")
        return blocks.head(b, w, h)
