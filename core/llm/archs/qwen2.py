"""The qwen2 architecture (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen): llama's stack with RoPE in neox mode;
its files carry biases on the query, key and value products (optional in the shared table, as in llama.cpp)."""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.archs.base import Arch
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor


class Qwen2(Arch):
    name = "qwen2"
    rope_mode = ops.ROPE_NEOX

    def build(self, b: Build, w: Weights) -> Tensor:
        h = blocks.decoder(b, w, lambda L, x, il: blocks.self_attention(b, L, x, il, self.rope_mode),
                           lambda L, x, il: blocks.ffn_swiglu(x, L.ffn_gate, L.ffn_up, L.ffn_down, il))
        return blocks.head(b, w, h)
