"""The gemma2 architecture: gemma's sandwich of RMS norms around attention and GeGLU feed-forward,
scaled embeddings, RoPE in neox mode, every other layer (the even ones) attending within a sliding
window, attention scores and final logits soft-capped (cap * tanh(x / cap)), tied output head."""
from __future__ import annotations

import math

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.archs.base import Arch
from ggrun.core.llm.archs.gemma3 import GEMMA_LAYER
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.checks import Key, MAX_CONTEXT
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor

SWA_PATTERN = 2  # layers il with il % 2 < 1 attend within the sliding window
LAYERS_27B = 46  # gemma-2-27b scales queries by n_embd / n_head rather than the head size


class Gemma2(Arch):
    name = "gemma2"
    rope_mode = ops.ROPE_NEOX
    keys = (Key("attention.sliding_window", int, 1, MAX_CONTEXT, default=4096, extra="swa_window"),
            Key("attn_logit_softcapping", float, 0.0, 1e6, lo_open=True, default=50.0, extra="attn_softcap"),
            Key("final_logit_softcapping", float, 0.0, 1e6, lo_open=True, default=30.0, extra="final_softcap"))
    swa_pattern = SWA_PATTERN
    layer_tensors = GEMMA_LAYER

    def hparams(self, gf) -> HParams:
        hp = super().hparams(gf)
        per_head = hp.n_embd // hp.n_head if hp.n_layer == LAYERS_27B else hp.head_dim
        hp.extra["attn_scale"] = 1.0 / math.sqrt(per_head)
        return hp

    def build(self, b: Build, w: Weights) -> Tensor:
        hp = b.hp
        swa = self.swa_layers(hp)

        def attn(L, x, il):
            return blocks.self_attention(b, L, x, il, self.rope_mode, biases=False, q_scale=hp.extra["attn_scale"],
                                         kq_scale=1.0, mask=b.inp.kq_mask_swa.tensor if swa[il] else None,
                                         softcap=hp.extra["attn_softcap"])

        h = blocks.decoder(b, w, attn, lambda L, x, il: blocks.ffn_geglu(b, x, L.ffn_gate, L.ffn_up, L.ffn_down, il),
                           sandwich=True, embd_scale=math.sqrt(hp.n_embd))
        return blocks.head(b, w, h, softcap=hp.extra["final_softcap"])
