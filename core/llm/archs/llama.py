"""The llama architecture (also SmolLM2): RMSNorm, RoPE in normal mode, grouped-query
attention over the KV cache, SwiGLU feed-forward, tied or separate output head."""
from __future__ import annotations

from core import ops
from core.llm import blocks
from core.llm.blocks import Build
from core.llm.weights import Weights
from core.tensor import Tensor

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
ROPE_MODE = ops.ROPE_NORMAL


def build(b: Build, w: Weights) -> Tensor:
    """Logits [n_outputs, n_vocab] of the micro-batch in b.inp."""
    hp = b.hp
    x = ops.get_rows(w["token_embd.weight"], b.inp.tokens.tensor, name="inp_embd")
    for il in range(hp.n_layer):
        L = w.layer(il)
        h = blocks.rms_norm(b, x, L.attn_norm, f"attn_norm-{il}")
        q = blocks.rope(b, blocks.project_heads(h, L.attn_q, hp.n_head, hp.head_dim, f"q-{il}"), ROPE_MODE)
        k = blocks.rope(b, blocks.project_heads(h, L.attn_k, hp.n_head_kv, hp.head_dim, f"k-{il}"), ROPE_MODE)
        v = blocks.project_heads(h, L.attn_v, hp.n_head_kv, hp.head_dim, f"v-{il}")
        h = blocks.attention(b, il, q, k, v, L.attn_output)
        if il == hp.n_layer - 1:
            h, x = blocks.select_outputs(b, h, x)
        x = ops.add(h, x, name=f"attn_residual-{il}")
        h = blocks.rms_norm(b, x, L.ffn_norm, f"ffn_norm-{il}")
        h = blocks.ffn_swiglu(h, L.ffn_gate, L.ffn_up, L.ffn_down, il)
        x = ops.add(h, x, name=f"l_out-{il}")
    x = blocks.rms_norm(b, x, w["output_norm.weight"], "result_norm")
    return ops.mul_mat(w["output.weight"], x, name="result_output")
