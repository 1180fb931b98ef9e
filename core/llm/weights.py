"""Model weights by GGUF tensor name, with per-layer access by short name (`layer(3).attn_q`)."""
from __future__ import annotations

from ggrun.core.errors import BadInput
from ggrun.core.tensor import Tensor


class LayerWeights:
    """The tensors `blk.<il>.<short>.weight` of one layer, reachable as attributes."""

    def __init__(self, weights: "Weights", il: int) -> None:
        self._w = weights
        self._il = il

    def __getattr__(self, short: str) -> Tensor:
        return self._w[f"blk.{self._il}.{short}.weight"]

    def get(self, name: str) -> Tensor | None:
        """Tensor `blk.<il>.<name>` (name with its suffix, e.g. "attn_q.bias"), or None where the file has none."""
        return self._w.get(f"blk.{self._il}.{name}")


class Weights:
    """All weight tensors of a model, placed on their backends."""

    def __init__(self, tensors: dict[str, Tensor], source: str, tied: bool = False) -> None:
        self.tensors = tensors
        self.source = source
        self.tied = tied  # the file has no output.weight: the head is the token embedding (a copy where placed apart)

    def __getitem__(self, name: str) -> Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise BadInput(f"{self.source}: missing tensor {name}")
        return t

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    def layer(self, il: int) -> LayerWeights:
        return LayerWeights(self, il)
