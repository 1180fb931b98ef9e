"""Building blocks shared by architectures: norms, attention over the KV cache, feed-forward.

Each block only composes engine ops; architectures call them with their own weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ggrun.core import ops, rowsplit
from ggrun.core.backends.base import Backend
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.inputs import GraphInputs, GraphParams
from ggrun.core.llm.kv_cache import heads_view, KVCache
from ggrun.core.llm.weights import LayerWeights, Weights
from ggrun.core.tensor import Tensor


@dataclass
class Build:
    """What a graph builder works with: hyperparameters, inputs, the cache and the shapes."""

    hp: HParams
    inp: GraphInputs
    kv: KVCache
    p: GraphParams
    flash_attn: bool = False  # fused attention: no [heads, tokens, n_kv] score tensor in the plan
    llama_numerics: bool = True  # round elementwise results as llama.cpp's CPU does (GELU table)
    kv_swa: KVCache | None = None  # the sliding-window layers' own cache (iSWA), if the model has one
    rope_factors: Tensor | None = None  # every RoPE's frequency factors (Arch.rope_factors), if the model has them

    def cache_of(self, il: int) -> tuple[KVCache, Tensor, int]:
        """Layer il's cache, the input with the rows this micro-batch writes there, and the cells read."""
        if self.kv_swa is not None and il in self.kv_swa.layers:
            return self.kv_swa, self.inp.kv_idx_swa.tensor, self.p.n_kv_swa
        return self.kv, self.inp.kv_idx.tensor, self.p.n_kv


def embed(b: Build, w: Weights) -> Tensor:
    """The micro-batch's token embeddings [tokens, n_embd], rows of token_embd. llama.cpp keeps token_embd on
    the CPU, which looks the rows up and copies them to the first offloaded layer. A tied head offloaded
    holds token_embd's rows on its device anyway, so where that device runs the lookup, the rows come from
    there: only the token ids travel, and a GPU decode step has no CPU split (its lookup and its copies).
    Not for a prompt whose layers begin on another device (layers split, micro-batches pipelined): there
    each micro-batch's lookup would queue behind the last device's work on the one before, and the devices
    would take turns instead of overlapping (measured on 2 H200s: 1.0x one GPU), so the CPU looks it up."""
    table, head = w["token_embd.weight"], w.get("output.weight")
    if w.tied and head is not None and head is not table and head.root.buffer is not None:
        device = head.root.buffer.backend
        lookup = ops.get_rows(head, b.inp.tokens.tensor, name="inp_embd")
        if device.supports_op(lookup) and (b.p.n_tokens == 1 or _first_layer_backend(w) in (None, device)):
            return lookup
    return ops.get_rows(table, b.inp.tokens.tensor, name="inp_embd")


def _first_layer_backend(w: Weights) -> Backend | None:
    """The backend holding the first layer's weights (None for a model without layers or memory)."""
    t = next((t for name, t in w.tensors.items() if name.startswith("blk.0.")), None)
    return t.root.buffer.backend if t is not None and t.root.buffer is not None else None


def norm(b: Build, x: Tensor, w: Tensor, name: str) -> Tensor:
    """RMS norm times its weight, one node (w spans the last axis: per channel, or per head dim)."""
    return ops.rms_norm_mul(x, w, b.hp.norm_eps, name=name)


# Micro-batches up to this many tokens add the residual inside the next norm's node. That node's
# result holds the stream and its normalised form side by side, so the normalised half lives as
# long as the stream: a few KB for a decode step, 1 MB of a SmolLM2 prompt's plan (and gaps in
# it), so larger micro-batches keep the add and the norm as two nodes.
FUSED_ADD_MAX_TOKENS = 32


def add_norm(b: Build, x: Tensor, h: Tensor | None, w: Tensor, name: str, stream: str,
             post: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The residual stream after adding h to x, and its norm times w: (x + h, norm(x + h) * w).

    With `post`, h is first normalised by its own weight (gemma3's norms after attention and
    feed-forward). Without h (the first layer) the stream is x itself."""
    if h is None:
        return x, norm(b, x, w, name)
    if x.shape[0] > FUSED_ADD_MAX_TOKENS:
        if post is not None:
            h = norm(b, h, post, f"{name}.post")
        x = ops.add(x, h, name=stream)
        return x, norm(b, x, w, name)
    both = ops.add_rms_norm(x, h, w, b.hp.norm_eps, post=post, name=f"{stream}+{name}")
    half = x.n_elements * 4
    return ops.view(both, x.shape, name=stream), ops.view(both, x.shape, offset=half, name=name)


def products(x: Tensor, ws: tuple[Tensor, ...], names: tuple[str, ...], name: str) -> list[Tensor]:
    """x [tokens, K] through each weight of ws, named `names`: one mul_mat_multi node `name` where
    the weights' backend runs that op (on the CPU one kernel call, x quantized once), one per device for
    weights split by rows over devices (rowsplit.products), else one mul_mat node per weight."""
    by_device = rowsplit.products(ws, x, names, name)  # matrices split by rows over devices (-sm row)
    if by_device is not None:
        return by_device
    fused = ops.mul_mat_multi(ws, x, names, name=name)
    home = _home(ws)
    if home is not None and home.supports_op(fused[0].view_src):
        return fused
    return [rowsplit.mul_mat(w, x, name=n) for w, n in zip(ws, names)]


def _home(ws: tuple[Tensor, ...]) -> Backend | None:
    """The one backend that holds every weight of ws, or None (weights spread or not placed)."""
    homes = {w.root.buffer.backend for w in ws if w.root.buffer is not None}
    return homes.pop() if len(homes) == 1 else None


def project_qkv(b: Build, x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, il: int,
                biases: tuple[Tensor | None, ...] = (None, None, None)) -> tuple[Tensor, Tensor, Tensor]:
    """x [tokens, n_embd] through the query, key and value weights (plus each bias given), split into heads:
    q [tokens, n_head, head_dim], k and v [tokens, n_head_kv, head_dim]."""
    hp = b.hp
    q, k, v = products(x, (wq, wk, wv), (f"q-{il}", f"k-{il}", f"v-{il}"), name=f"qkv-{il}")
    q, k, v = (y if bias is None else ops.add(y, bias, name=f"{y.name}_biased")
               for y, bias in zip((q, k, v), biases))
    n = x.shape[0]
    return (ops.reshape(q, (n, hp.n_head, hp.head_dim)), ops.reshape(k, (n, hp.n_head_kv, hp.head_dim)),
            ops.reshape(v, (n, hp.n_head_kv, hp.head_dim)))


def rope(b: Build, x: Tensor, mode: int, freq_base: float | None = None, out_scale: float = 1.0,
         norm: Tensor | None = None, name: str | None = None) -> Tensor:
    """RoPE of x [tokens, heads, head_dim] at the micro-batch's positions, each head first normalised
    by `norm` when given (q/k norms), the result times out_scale: one node."""
    hp = b.hp
    return ops.rope(x, b.inp.pos.tensor, hp.n_rot, mode, hp.rope_freq_base if freq_base is None else freq_base,
                    hp.rope_freq_scale, name=name, out_scale=out_scale, norm=norm, eps=hp.norm_eps, yarn=yarn_of(hp),
                    factors=b.rope_factors)


def yarn_of(hp: HParams) -> ops.Yarn | None:
    """The model's YaRN RoPE settings (an architecture that reads them keeps them in extra["yarn"]), or None."""
    return hp.extra.get("yarn")


def attention(b: Build, il: int, q: Tensor, k: Tensor, v: Tensor, wo: Tensor, rope_mode: int,
              freq_base: float | None = None, kq_scale: float | None = None, mask: Tensor | None = None,
              k_norm: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
              wo_bias: Tensor | None = None) -> Tensor:
    """Rotate k [tokens, heads_kv, head_dim] (each head first normalised by k_norm when given) as it
    is written into layer il's cache (one node), write v, attend with q [tokens, heads, head_dim]
    (already rotated) over the first n_kv cells, and project with wo (plus wo_bias). With softcap, the
    scores are soft-capped before the softmax (gemma2); with sinks [n_head], each head's softmax counts
    one more logit (gpt-oss's attention sinks), fused or not. The fused attention has no soft-cap, so that
    takes the scores path."""
    hp = b.hp
    n_tokens = q.shape[0]
    cache, idx, n_kv = b.cache_of(il)
    rows = cache.layers[il]
    base = hp.rope_freq_base if freq_base is None else freq_base
    if yarn_of(hp) is None and b.rope_factors is None:
        k_all = ops.rope_set_rows(rows.k, k, idx, b.inp.pos.tensor, hp.n_rot, rope_mode, base, hp.rope_freq_scale,
                                  name=f"k_store-{il}", norm=k_norm, eps=hp.norm_eps)
    else:  # YaRN's or LongRoPE's RoPE may run elsewhere than the cache (a backend without it): rotated first,
        # then written there
        k_rot = ops.rope(k, b.inp.pos.tensor, hp.n_rot, rope_mode, base, hp.rope_freq_scale, name=f"k_rot-{il}",
                         norm=k_norm, eps=hp.norm_eps, yarn=yarn_of(hp), factors=b.rope_factors)
        k_all = ops.set_rows(rows.k, ops.reshape(k_rot, (n_tokens, hp.n_embd_kv)), idx, name=f"k_store-{il}")
    v_all = ops.set_rows(rows.v, ops.reshape(v, (n_tokens, hp.n_embd_kv)), idx, name=f"v_store-{il}")
    keys = ops.permute(heads_view(k_all, n_kv, hp.n_head_kv, hp.head_dim), (1, 0, 2))  # [heads_kv, n_kv, head_dim]
    qh = ops.permute(q, (1, 0, 2))  # [heads, tokens, head_dim]
    scale = kq_scale if kq_scale is not None else 1.0 / math.sqrt(hp.head_dim)
    kq_mask = b.inp.mask_on(b.inp.kq_mask.tensor if mask is None else mask, _home((rows.k,)))
    if b.flash_attn and softcap is None:
        vals = ops.permute(heads_view(v_all, n_kv, hp.n_head_kv, hp.head_dim), (1, 0, 2))  # [heads_kv, n_kv, head_dim]
        merged = ops.flash_attn(qh, keys, vals, kq_mask, scale, name=f"fattn-{il}",
                                sinks=sinks)  # [tokens, heads, head_dim]
        if b.p.one_per_seq:  # each token of its own sequence: a backend may attend token by token
            merged.params["per_token"] = True
        if b.p.shared:  # and read a prefix of cells the tokens share once for all of them
            merged.params["shared_prefix"] = True
    else:
        vals = ops.permute(heads_view(v_all, n_kv, hp.n_head_kv, hp.head_dim), (1, 2, 0))  # [heads_kv, head_dim, n_kv]
        kq = ops.mul_mat(keys, qh, name=f"kq-{il}")  # [heads, tokens, n_kv]
        if softcap is not None:
            kq = ops.softcap(kq, softcap, name=f"kq_capped-{il}")
        kq = ops.soft_max(kq, kq_mask, scale, name=f"kq_soft_max-{il}", sinks=sinks)
        kqv = ops.mul_mat(vals, kq, name=f"kqv-{il}")  # [heads, tokens, head_dim]
        merged = ops.cont(ops.permute(kqv, (1, 0, 2)), name=f"kqv_merged-{il}")
    out = rowsplit.mul_mat(wo, ops.reshape(merged, (n_tokens, hp.n_head * hp.head_dim)), name=f"attn_out-{il}")
    return out if wo_bias is None else ops.add(out, wo_bias, name=f"attn_out_biased-{il}")


def self_attention(b: Build, L: LayerWeights, h: Tensor, il: int, rope_mode: int, *, biases: bool = True,
                   qk_norm: bool = False, q_scale: float = 1.0, kq_scale: float | None = None,
                   freq_base: float | None = None, mask: Tensor | None = None,
                   softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Layer il's attention of h [tokens, n_embd] over the cache, projected back to [tokens, n_embd]:
    q/k/v products (plus the biases the file holds, unless the family has none), each q and k
    head RMS-normalised by attn_q_norm/attn_k_norm with qk_norm, RoPE, queries times q_scale, scores
    times kq_scale (default 1/sqrt(head_dim)), on the window's mask when given, soft-capped by softcap,
    with attention sinks when given; the output projection's bias where the file has one."""
    bias = (L.get("attn_q.bias"), L.get("attn_k.bias"), L.get("attn_v.bias")) if biases else (None, None, None)
    q, k, v = project_qkv(b, h, L.attn_q, L.attn_k, L.attn_v, il, bias)
    q_norm = L.attn_q_norm if qk_norm else None
    name = f"q_scaled-{il}" if q_scale != 1.0 else None
    q = rope(b, q, rope_mode, freq_base, out_scale=q_scale, norm=q_norm, name=name)
    return attention(b, il, q, k, v, L.attn_output, rope_mode, freq_base, kq_scale=kq_scale, mask=mask,
                     k_norm=L.attn_k_norm if qk_norm else None, softcap=softcap, sinks=sinks,
                     wo_bias=L.get("attn_output.bias") if biases else None)


def gated(x: Tensor, gate: Tensor, up: Tensor, il: int, glu: str, f16_table: bool = False) -> Tensor:
    """glu(x @ gate^T, x @ up^T) ("swiglu" or "geglu"): one mul_mat_glu node where the weights'
    backend runs it (the CPU, CUDA, SIM), else the products (products()) and a swiglu/geglu node."""
    by_device = rowsplit.mul_mat_glu(gate, up, x, glu, f16_table, name=f"ffn_{glu}-{il}")  # -sm row
    if by_device is not None:
        return by_device
    fused = ops.mul_mat_glu(gate, up, x, glu, f16_table, name=f"ffn_{glu}-{il}")
    home = _home((gate, up))
    if home is not None and home.supports_op(fused):
        return fused
    g, u = products(x, (gate, up), (f"ffn_gate-{il}", f"ffn_up-{il}"), name=f"ffn_gate_up-{il}")
    if glu == "swiglu":
        return ops.swiglu(g, u, name=f"ffn_swiglu-{il}")
    return ops.geglu(g, u, name=f"ffn_geglu-{il}", f16_table=f16_table)


def ffn_swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, il: int) -> Tensor:
    """down(silu(gate(x)) * up(x)): the llama family's feed-forward."""
    return rowsplit.mul_mat(down, gated(x, gate, up, il, "swiglu"), name=f"ffn_out-{il}")


def ffn_geglu(b: Build, x: Tensor, gate: Tensor, up: Tensor, down: Tensor, il: int) -> Tensor:
    """down(gelu(gate(x)) * up(x)): the gemma family's feed-forward."""
    h = gated(x, gate, up, il, "geglu", f16_table=b.llama_numerics)
    return rowsplit.mul_mat(down, h, name=f"ffn_out-{il}")


Glu = Callable[[Tensor, Tensor, str], Tensor]


def ffn_moe(x: Tensor, L: LayerWeights, il: int, n_used: int, norm_weights: bool = True,
            softmax_weights: bool = False, glu: Glu | None = None) -> Tensor:
    """A mixture of gated experts on x [tokens, n_embd]: the router (ffn_gate_inp, plus its bias where the file
    has one) scores the experts, each token goes to its n_used likeliest (softmax, top-k), whose outputs are
    summed weighted by their probabilities (renormalised to sum 1 with norm_weights), as llama.cpp's
    build_moe_ffn. With softmax_weights (gpt-oss, llama.cpp's SOFTMAX_WEIGHT gating) the router's logits pick
    the experts and the softmax of the chosen ones weighs them. The experts' products are mul_mat_id nodes,
    which read only the chosen experts' matrices; each adds its chosen experts' rows of its bias
    (ffn_*_exps.bias) where the file has them (ggml_add_id). glu(gate, up, name) is the gated unit (SwiGLU)."""
    n = x.shape[0]
    logits = rowsplit.mul_mat(L.ffn_gate_inp, x, name=f"ffn_moe_logits-{il}")
    router_bias = L.get("ffn_gate_inp.bias")
    if router_bias is not None:
        logits = ops.add(logits, router_bias, name=f"ffn_moe_logits_biased-{il}")
    probs = logits if softmax_weights else ops.soft_max(logits, name=f"ffn_moe_probs-{il}")
    ids = ops.moe_topk(probs, n_used, name=f"ffn_moe_topk-{il}")  # [tokens, n_used]
    weights = ops.moe_weights(probs, ids, norm_weights and not softmax_weights,
                              name=f"ffn_moe_weights-{il}")  # [tokens, n_used]
    if softmax_weights:
        weights = ops.soft_max(weights, name=f"ffn_moe_weights_softmax-{il}")
    xs = ops.reshape(x, (n, 1, x.shape[1]))
    gate = _experts(L, "ffn_gate_exps", xs, ids, f"ffn_moe_gate-{il}")  # [tokens, n_used, n_ff_exp]
    up = _experts(L, "ffn_up_exps", xs, ids, f"ffn_moe_up-{il}")
    h = glu(gate, up, f"ffn_moe_glu-{il}") if glu is not None else ops.swiglu(gate, up, name=f"ffn_moe_swiglu-{il}")
    experts = _experts(L, "ffn_down_exps", h, ids, f"ffn_moe_down-{il}")  # [tokens, n_used, n_embd]
    return weighted_sum(experts, weights, il)


def weighted_sum(experts: Tensor, weights: Tensor, il: int) -> Tensor:
    """The experts' outputs [tokens, n_used, n_embd] weighted by weights [tokens, n_used] and summed one
    expert after another, in llama.cpp's order: [tokens, n_embd]."""
    n, n_used, n_embd = experts.shape
    experts = ops.mul(experts, ops.reshape(weights, (n, n_used, 1)), name=f"ffn_moe_weighted-{il}")
    row = (n_used * n_embd * 4, 4)
    out = ops.view(experts, (n, n_embd), row, 0, name=f"ffn_moe_expert0-{il}")
    for j in range(1, n_used):
        out = ops.add(out, ops.view(experts, (n, n_embd), row, j * n_embd * 4), name=f"ffn_moe_sum{j}-{il}")
    return out if n_used > 1 else ops.cont(out, name=f"ffn_moe_out-{il}")


def _experts(L: LayerWeights, name: str, x: Tensor, ids: Tensor, node: str) -> Tensor:
    """The chosen experts' products with layer matrix `name`, plus its bias where the file has one."""
    return expert_product(getattr(L, name), L.get(f"{name}.bias"), x, ids, node)


def expert_product(w: Tensor, bias: Tensor | None, x: Tensor, ids: Tensor, node: str) -> Tensor:
    """The chosen experts' products with w [n_expert, M, K], plus their rows of bias [n_expert, M] when given (as
    ggml_add_id adds them: the rows gathered by the ids, then added): [tokens, n_used, M]."""
    y = ops.mul_mat_id(w, x, ids, name=node)
    if bias is None:
        return y
    rows = ops.get_rows(bias, ops.reshape(ids, (ids.shape[0] * ids.shape[1],)), name=f"{node}_bias_rows")
    return ops.add(y, ops.reshape(rows, y.shape), name=f"{node}_biased")


Sublayer = Callable[[LayerWeights, Tensor, int], Tensor]


def decoder(b: Build, w: Weights, attn: Sublayer, ffn: Sublayer, sandwich: bool = False,
            embd_scale: float | None = None, ffn_norm: str = "ffn_norm") -> Tensor:
    """The stack every family shares: token embeddings (times embd_scale), then per layer
    x += attn(norm(x)), x += ffn(norm(x)), and the output norm of the stream [n_outputs, n_embd].

    `attn` and `ffn` map (layer weights, normalised stream, layer) to what is added. With `sandwich`
    (the gemma family) each result is first normalised by the layer's post_attention_norm/post_ffw_norm.
    Each addition happens inside the next norm's node (add_norm), and the last layer keeps only the rows
    that need logits before its tail. `ffn_norm` names the norm before the feed-forward (gpt-oss:
    post_attention_norm)."""
    hp = b.hp
    x = embed(b, w)
    if embd_scale is not None:
        x = ops.scale(x, embd_scale, name="inp_scaled")
    out = None  # the previous layer's feed-forward output, added to the stream with the next norm
    for il in range(hp.n_layer):
        L = w.layer(il)
        post = w.layer(il - 1).post_ffw_norm if sandwich and il else None
        x, h = add_norm(b, x, out, L.attn_norm, f"attn_norm-{il}", stream=f"l_out-{il - 1}", post=post)
        a = attn(L, h, il)
        if il == hp.n_layer - 1:
            a, x = select_outputs(b, a, x)
        x, h = add_norm(b, x, a, getattr(L, ffn_norm), f"ffn_norm-{il}", stream=f"attn_residual-{il}",
                        post=L.post_attention_norm if sandwich else None)
        out = ffn(L, h, il)
    post = w.layer(hp.n_layer - 1).post_ffw_norm if sandwich else None
    _, h = add_norm(b, x, out, w["output_norm.weight"], "result_norm", stream=f"l_out-{hp.n_layer - 1}", post=post)
    return h


def head(b: Build, w: Weights, h: Tensor, softcap: float | None = None) -> Tensor:
    """Logits [n_outputs, n_vocab] of the normalised stream h: the output matrix, soft-capped when asked."""
    logits = rowsplit.mul_mat(w["output.weight"], h, name="result_output" if softcap is None else "result_uncapped")
    return logits if softcap is None else ops.softcap(logits, softcap, name="result_output")


def select_outputs(b: Build, *xs: Tensor) -> tuple[Tensor, ...]:
    """Keep only the rows that need logits (when fewer than all), before the last layer's tail."""
    if b.inp.out_ids is None:
        return xs
    ids = b.inp.out_ids.tensor
    return tuple(ops.get_rows(x, ids) for x in xs)


def build_k_shift(hp: HParams, kv: KVCache, mode: int, freq_base_of=lambda il: None,
                  factors: Tensor | None = None):
    """A graph that re-rotates every cached key by its cell's position delta (after seq_add), with the
    model's RoPE frequency factors where it has them.

    RoPE is a rotation, so rotating by the delta equals rotating from scratch at the new position.
    """
    from ggrun.core.graph import build_graph
    from ggrun.core.llm.inputs import InpKShift

    shift = InpKShift(kv.n_ctx)
    outs = []
    for il, rows in kv.layers.items():
        k = ops.view(rows.k, (kv.n_ctx, hp.n_head_kv, hp.head_dim))
        base = freq_base_of(il)
        r = ops.rope(k, shift.tensor, hp.n_rot, mode, hp.rope_freq_base if base is None else base,
                     hp.rope_freq_scale, name=f"k_shift-{il}", yarn=yarn_of(hp), factors=factors)
        outs.append(ops.cpy(r, k, name=f"k_shifted-{il}"))
    return build_graph(outs), shift
