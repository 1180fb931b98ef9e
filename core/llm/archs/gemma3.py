"""The gemma3 architecture: scaled embeddings, RMS norms before and after attention and
feed-forward, per-head RMS norms on q and k, RoPE in neox mode with a local base on
sliding-window layers (5 of every 6) and a global base on the rest, GeGLU feed-forward,
tied output head."""
from __future__ import annotations

import math

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.archs import base
from ggrun.core.llm.archs.base import Arch
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.checks import Key, MAX_CONTEXT
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor

SWA_PATTERN = 6  # layers il with il % 6 < 5 attend within the sliding window
ROPE_BASE_SWA = 10000.0

GEMMA_LAYER = (base.ATTN_NORM, base.ATTN_Q, base.ATTN_K, base.ATTN_V, base.ATTN_OUT, base.POST_ATTN_NORM,
               base.FFN_NORM, base.FFN_GATE, base.FFN_UP, base.FFN_DOWN, base.POST_FFW_NORM)


class Gemma3(Arch):
    name = "gemma3"
    rope_mode = ops.ROPE_NEOX
    # absent: no sliding window; present, a window of at least one cell (llama.cpp's loader needs one)
    keys = (Key("attention.sliding_window", int, 1, MAX_CONTEXT, default=0, extra="swa_window"),)
    swa_pattern = SWA_PATTERN
    layer_tensors = GEMMA_LAYER + (base.ATTN_Q_NORM, base.ATTN_K_NORM)

    def hparams(self, gf) -> HParams:
        hp = super().hparams(gf)
        hp.extra["swa_window"] = hp.extra["swa_window"] or None
        hp.extra["attn_scale"] = 1.0 / math.sqrt(hp.head_dim)
        return hp

    def rope_freq_base(self, hp: HParams, il: int) -> float:
        """The local base on sliding-window layers, the file's on the global ones."""
        return ROPE_BASE_SWA if self.swa_layers(hp)[il] else hp.rope_freq_base

    def build(self, b: Build, w: Weights) -> Tensor:
        hp = b.hp
        swa = self.swa_layers(hp)

        def attn(L, x, il):
            return blocks.self_attention(b, L, x, il, self.rope_mode, biases=False, qk_norm=True,
                                         q_scale=hp.extra["attn_scale"], kq_scale=1.0, freq_base=self.rope_freq_base(hp, il),
                                         mask=b.inp.kq_mask_swa.tensor if swa[il] else None)

        h = blocks.decoder(b, w, attn, lambda L, x, il: blocks.ffn_geglu(b, x, L.ffn_gate, L.ffn_up, L.ffn_down, il),
                           sandwich=True, embd_scale=math.sqrt(hp.n_embd))
        return blocks.head(b, w, h)
