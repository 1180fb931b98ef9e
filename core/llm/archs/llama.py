"""The llama architecture (also SmolLM2): RMSNorm, RoPE in normal mode, grouped-query
attention over the KV cache, SwiGLU feed-forward, tied or separate output head."""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.archs.base import Arch
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor


class Llama(Arch):
    name = "llama"
    rope_mode = ops.ROPE_NORMAL

    def build(self, b: Build, w: Weights) -> Tensor:
        h = blocks.decoder(b, w, attn=lambda L, x, il: blocks.self_attention(b, L, x, il, self.rope_mode),
                           ffn=lambda L, x, il: blocks.ffn_swiglu(x, L.ffn_gate, L.ffn_up, L.ffn_down, il))
        return blocks.head(b, w, h)
