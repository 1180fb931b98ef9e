"""The architecture contract: what a model family gives the runtime, and nothing else.

A family is one subclass of Arch (core/llm/archs/<name>.py) holding its metadata keys beyond the common
ones (with defaults, read into HParams.extra), its per-layer tensor table (required and optional entries,
such as biases), the matrices its files store fused and the runtime loads as parts, which layers attend
within a sliding window, the RoPE mode and per-layer base, and the graph: its math over the shared blocks
of core/llm/blocks.py. The registry (core/llm/archs/__init__.py) maps `general.architecture` to one.
It never reads tensor data: checks and `ggrun measure` use it on metadata alone.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

from ggrun.core import ops
from ggrun.core.errors import BadInput
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.checks import Key
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.weights import Weights
from ggrun.core.tensor import Tensor


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of every layer, `blk.<il>.<name>`: its shape (numpy order) from the hyperparameters, the
    same in words for messages, whether a file must have it, and whether it is a norm weight (F32 only)."""

    name: str
    dims: str
    shape: Callable[[HParams], tuple[int, ...]]
    required: bool = True
    norm: bool = False

    def optional(self) -> "TensorSpec":
        return replace(self, required=False)


def _q(hp: HParams) -> int:
    return hp.n_head * hp.head_dim


def _norm(name: str) -> TensorSpec:
    return TensorSpec(f"{name}.weight", "[n_embd]", lambda hp: (hp.n_embd,), norm=True)


def _head_norm(name: str) -> TensorSpec:
    return TensorSpec(f"{name}.weight", "[head_dim]", lambda hp: (hp.head_dim,), norm=True)


# The tensors the families share, by llama.cpp's names.
ATTN_NORM = _norm("attn_norm")
FFN_NORM = _norm("ffn_norm")
POST_ATTN_NORM = _norm("post_attention_norm")
POST_FFW_NORM = _norm("post_ffw_norm")
ATTN_Q_NORM = _head_norm("attn_q_norm")
ATTN_K_NORM = _head_norm("attn_k_norm")
ATTN_Q = TensorSpec("attn_q.weight", "[n_head * head_dim, n_embd]", lambda hp: (_q(hp), hp.n_embd))
ATTN_K = TensorSpec("attn_k.weight", "[n_head_kv * head_dim, n_embd]", lambda hp: (hp.n_embd_kv, hp.n_embd))
ATTN_V = TensorSpec("attn_v.weight", "[n_head_kv * head_dim, n_embd]", lambda hp: (hp.n_embd_kv, hp.n_embd))
ATTN_OUT = TensorSpec("attn_output.weight", "[n_embd, n_head * head_dim]", lambda hp: (hp.n_embd, _q(hp)))
ATTN_QKV = TensorSpec("attn_qkv.weight", "[(n_head + 2 * n_head_kv) * head_dim, n_embd]",
                      lambda hp: (_q(hp) + 2 * hp.n_embd_kv, hp.n_embd))
# q/k/v biases: optional wherever llama.cpp projects through build_qkv (it adds them when the file has them)
ATTN_Q_BIAS = TensorSpec("attn_q.bias", "[n_head * head_dim]", lambda hp: (_q(hp),), required=False)
ATTN_K_BIAS = TensorSpec("attn_k.bias", "[n_head_kv * head_dim]", lambda hp: (hp.n_embd_kv,), required=False)
ATTN_V_BIAS = TensorSpec("attn_v.bias", "[n_head_kv * head_dim]", lambda hp: (hp.n_embd_kv,), required=False)
ATTN_QKV_BIAS = TensorSpec("attn_qkv.bias", "[(n_head + 2 * n_head_kv) * head_dim]",
                           lambda hp: (_q(hp) + 2 * hp.n_embd_kv,), required=False)
FFN_GATE = TensorSpec("ffn_gate.weight", "[n_ff, n_embd]", lambda hp: (hp.n_ff, hp.n_embd))
FFN_UP = TensorSpec("ffn_up.weight", "[n_ff, n_embd]", lambda hp: (hp.n_ff, hp.n_embd))
FFN_DOWN = TensorSpec("ffn_down.weight", "[n_embd, n_ff]", lambda hp: (hp.n_embd, hp.n_ff))

QKV_BIASES = (ATTN_Q_BIAS, ATTN_K_BIAS, ATTN_V_BIAS)
LLAMA_LAYER = (ATTN_NORM, ATTN_Q, ATTN_K, ATTN_V, ATTN_OUT, FFN_NORM, FFN_GATE, FFN_UP, FFN_DOWN) + QKV_BIASES


def check_rope_factors(gf, hp: HParams, names: tuple[str, ...]) -> bool:
    """Check that each of the RoPE frequency factor tensors `names` (ggml_rope_ext's freq_factors) the file holds
    is f32 [n_rot / 2] (one line naming it if not); whether it holds any."""
    for name in names:
        info = gf.tensors.get(name)
        if info is not None and (info.shape != (hp.n_rot // 2,) or info.qtype.name != "F32"):
            raise BadInput(f"{gf.path}: tensor {name} has shape {list(info.shape)} and type {info.qtype.name}, "
                           f"expected F32 [n_rot / 2] = [{hp.n_rot // 2}]")
    return any(name in gf.tensors for name in names)


class Arch:
    """One model family. Subclasses set the class attributes and write `build`; the rest has defaults
    that fit a llama-like family (no extra keys, no sliding window, one RoPE base, nothing fused)."""

    name: ClassVar[str]
    rope_mode: ClassVar[int] = ops.ROPE_NORMAL
    keys: ClassVar[tuple[Key, ...]] = ()  # `<arch>.<key>` beyond checks.COMMON_KEYS; value or default in extra
    layer_tensors: ClassVar[tuple[TensorSpec, ...]] = LLAMA_LAYER
    swa_pattern: ClassVar[int] = 0  # llama.cpp's set_swa_pattern(n): which layers are the window's (swa_layers)

    def hparams(self, gf) -> HParams:
        """The common hyperparameters, and in `extra` each of `keys` by its extra name (its default when absent)."""
        n_vocab = len(gf.get("tokenizer.ggml.tokens") or []) or gf.require_tensor("token_embd.weight").shape[0]
        hp = HParams.from_metadata(gf.get, str(gf.path), n_vocab)
        extra: dict[str, Any] = {}
        for key in self.keys:
            value = gf.get(f"{self.name}.{key.name}")
            extra[key.extra or key.name] = key.default if value is None else key.kind(value)
        return replace(hp, extra=extra)

    def required_tensors(self, hp: HParams) -> list[tuple[str, ...]]:
        """Alternatives of which a file must hold one per layer (short names); by default each required
        entry of the table on its own. A family that accepts fused or separate matrices says so here."""
        return [(t.name,) for t in self.layer_tensors if t.required]

    def fused(self, hp: HParams, name: str) -> list[tuple[str, int]]:
        """For a stored per-layer matrix `name` that holds several by rows (fused q/k/v), the parts the
        runtime loads instead: (part name, rows) in order. Empty: loaded as stored."""
        return []

    def swa_layers(self, hp: HParams) -> list[bool]:
        """Which layers attend within the sliding window hp.extra['swa_window'] (they get the window's cache):
        with llama.cpp's set_swa_pattern(n) (`swa_pattern` n > 0), layer il where il % n < n - 1; none
        without a pattern or a window."""
        n = self.swa_pattern
        if not n or hp.extra.get("swa_window") is None:
            return [False] * hp.n_layer
        return [il % n < n - 1 for il in range(hp.n_layer)]

    def rope_freq_base(self, hp: HParams, il: int) -> float:
        """Layer il's RoPE base (the K-shift re-rotates with it too)."""
        return hp.rope_freq_base

    def rope_factors(self, w: Weights, hp: HParams, n_ctx: int) -> Tensor | None:
        """The RoPE frequency factors (ggml_rope_ext's freq_factors, f32 [n_rot / 2]) of a session whose cache
        holds n_ctx cells, or None: a family without them."""
        return None

    def build(self, b: Build, w: Weights) -> Tensor:
        """Logits [n_outputs, n_vocab] of the micro-batch in b.inp."""
        raise NotImplementedError
