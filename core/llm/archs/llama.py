"""The llama architecture (also SmolLM2): RMSNorm, RoPE in normal mode, grouped-query
attention over the KV cache, SwiGLU feed-forward, tied or separate output head."""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.llm import blocks
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
ROPE_MODE = ops.ROPE_NORMAL


def build(b: Build, w: Weights) -> Tensor:
    """Logits [n_outputs, n_vocab] of the micro-batch in b.inp."""
    hp = b.hp
    x = blocks.embed(b, w)
    ffn = None  # the previous layer's feed-forward output, added to the stream with the next norm
    for il in range(hp.n_layer):
        L = w.layer(il)
        x, h = blocks.add_norm(b, x, ffn, L.attn_norm, f"attn_norm-{il}", stream=f"l_out-{il - 1}")
        q, k, v = blocks.project_qkv(b, h, L.attn_q, L.attn_k, L.attn_v, il)
        q = blocks.rope(b, q, ROPE_MODE)
        attn = blocks.attention(b, il, q, k, v, L.attn_output, ROPE_MODE)
        if il == hp.n_layer - 1:
            attn, x = blocks.select_outputs(b, attn, x)
        x, h = blocks.add_norm(b, x, attn, L.ffn_norm, f"ffn_norm-{il}", stream=f"attn_residual-{il}")
        ffn = blocks.ffn_swiglu(h, L.ffn_gate, L.ffn_up, L.ffn_down, il)
    x, h = blocks.add_norm(b, x, ffn, w["output_norm.weight"], "result_norm", stream=f"l_out-{hp.n_layer - 1}")
    return ops.mul_mat(w["output.weight"], h, name="result_output")
