"""The llama architecture (also SmolLM2): RMSNorm, RoPE in normal mode, grouped-query
attention over the KV cache, SwiGLU feed-forward, tied or separate output head. Llama 3.1 and later files
hold rope_freqs (f32 [n_rot / 2]): every RoPE divides pair i's angle by its factor i, as llama.cpp's."""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.archs.base import Arch, check_rope_factors
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor

ROPE_FREQS = "rope_freqs.weight"


class Llama(Arch):
    name = "llama"
    rope_mode = ops.ROPE_NORMAL

    def hparams(self, gf) -> HParams:
        hp = super().hparams(gf)
        check_rope_factors(gf, hp, (ROPE_FREQS,))
        return hp

    def rope_factors(self, w: Weights, hp: HParams, n_ctx: int) -> Tensor | None:
        return w.get(ROPE_FREQS)

    def build(self, b: Build, w: Weights) -> Tensor:
        h = blocks.decoder(b, w, attn=lambda L, x, il: blocks.self_attention(b, L, x, il, self.rope_mode),
                           ffn=lambda L, x, il: blocks.ffn_swiglu(x, L.ffn_gate, L.ffn_up, L.ffn_down, il))
        return blocks.head(b, w, h)
