"""Which CPU kernels a loaded model's graphs meet, as the warm-up's tags (core/backends/cpu/precompile.py):
the weights its products read on the CPU (their types, repacked or not, with 8-bit or f32 activations; the
experts' block types), the token embedding it looks rows up in, its KV cache types, the thread count and RoPE
frequency factors."""
from __future__ import annotations

from typing import Iterable

from ggrun.core.backends.base import Backend
from ggrun.core.dtypes import DType
from ggrun.core.llm.model import Model
from ggrun.core.tensor import Tensor

EMBEDDING = "token_embd.weight"  # looked up by rows; a product's weight too where it is the (tied) head


def warm_tags(model: Model, cpu: Backend, kv_types: Iterable[DType] = (DType.F16,)) -> frozenset[str]:
    """The warm-up tags of `model`'s graphs on backend `cpu` with KV caches of `kv_types`."""
    from ggrun.core.backends.cpu import jit, precompile, warmup

    def here(t: Tensor) -> bool:
        return t.buffer is not None and t.buffer.backend is cpu

    tensors = model.weights.tensors
    matrices = {id(t): t for name, t in tensors.items()
                if name != EMBEDDING and len(t.shape) == 2 and here(t)}
    tables = [t for t in (tensors.get(EMBEDDING),) if t is not None and here(t)]
    experts = {warmup.experts(t.dtype) for t in tensors.values()
               if len(t.shape) == 3 and here(t) and "act_quant" in t.root.params}
    factors = any(model.arch.rope_factors(model.weights, model.hp, n_ctx) is not None for n_ctx in (1, 1 << 30))
    return precompile.tags(matrices.values(), tables, kv_types, jit.threads()) | experts | (
        {warmup.ROPE_FACTORS} if factors else frozenset())
