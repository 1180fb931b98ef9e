"""Model hyperparameters: a frozen record read once from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ggrun.core.errors import BadInput


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_freq_base: float
    rope_freq_scale: float
    norm_eps: float
    extra: dict[str, Any] = field(default_factory=dict)  # architecture-specific values

    @property
    def n_embd_kv(self) -> int:
        """Width of one cache row: the keys (or values) of all KV heads of one token."""
        return self.n_head_kv * self.head_dim

    @staticmethod
    def from_metadata(md_get: Callable[[str, Any], Any], source: str, n_vocab: int) -> "HParams":
        """Read llama-family hyperparameters; md_get(key, default) returns a metadata value."""
        arch = md_get("general.architecture", None)

        def need(key: str):
            v = md_get(f"{arch}.{key}", None)
            if v is None:
                raise BadInput(f"{source}: missing metadata key {arch}.{key}")
            return v

        n_embd = int(need("embedding_length"))
        n_head = int(need("attention.head_count"))
        head_dim = int(md_get(f"{arch}.attention.key_length", n_embd // n_head))
        scaling = md_get(f"{arch}.rope.scaling.factor", None)
        return HParams(
            arch=arch,
            n_vocab=n_vocab,
            n_ctx_train=int(need("context_length")),
            n_embd=n_embd,
            n_layer=int(need("block_count")),
            n_ff=int(need("feed_forward_length")),
            n_head=n_head,
            n_head_kv=int(md_get(f"{arch}.attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_rot=int(md_get(f"{arch}.rope.dimension_count", head_dim)),
            rope_freq_base=float(md_get(f"{arch}.rope.freq_base", 10000.0)),
            rope_freq_scale=1.0 / float(scaling) if scaling else 1.0,
            norm_eps=float(md_get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        )
