"""The qwen3 architecture: llama's stack with each query and key head RMS-normalised (attn_q_norm,
attn_k_norm) before RoPE in neox mode; the head size is attention.key_length, not n_embd / n_head."""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.archs import base
from ggrun.core.llm.archs.base import Arch
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor


class Qwen3(Arch):
    name = "qwen3"
    rope_mode = ops.ROPE_NEOX
    layer_tensors = base.LLAMA_LAYER + (base.ATTN_Q_NORM, base.ATTN_K_NORM)

    def build(self, b: Build, w: Weights) -> Tensor:
        h = blocks.decoder(b, w, lambda L, x, il: blocks.self_attention(b, L, x, il, self.rope_mode, qk_norm=True),
                           lambda L, x, il: blocks.ffn_swiglu(x, L.ffn_gate, L.ffn_up, L.ffn_down, il))
        return blocks.head(b, w, h)
