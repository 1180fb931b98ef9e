"""The CPU warm-up's registry: the kernel modules register small one-node graph builders here, with the
tags a model must have for their kernels to be worth compiling up front (`warms(build, needs=...)`): a
product of a weight type in its stored or repacked rows, with 8-bit or f32 activations (`product`), rows
looked up from a table of a type (`rows`), a KV cache type (`kv`), more than one thread (THREADS);
builders without tags serve every model. A kernel no builder warmed still works: numba compiles it on
its first call, later, without the progress bar.

Running them (a model's tags, the builders pending on this machine, the runs and their markers) is
precompile.py's, which imports the kernels; this module imports none of them, so that every kernel
module can register here.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor

THREADS = "threads"  # the kernels run on more than one thread: their parallel variants are met
ROPE_FACTORS = "rope factors"  # the model's RoPE divides its angles by frequency factors (Llama 3, LongRoPE)


def product(dtype: DType | None, packed: bool, act_quant: bool) -> str:
    """The tag of products with weight matrices of `dtype` (None: of any type) read in their repacked
    rows (`packed`, matmul.REPACKED) or as stored, against activations quantized to 8-bit blocks
    (`act_quant`, llama numerics) or in f32."""
    return f"mul_mat {dtype.name if dtype else 'any'} {'packed' if packed else 'stored'} {'q8' if act_quant else 'f32'}"


def rows(dtype: DType) -> str:
    """The tag of row lookups (get_rows: the token embedding) from a table stored as `dtype`."""
    return f"get_rows {dtype.name}"


def experts(dtype: DType) -> str:
    """The tag of a mixture of experts' products (mul_mat_id) with expert matrices of `dtype` under llama
    numerics (8-bit activations)."""
    return f"mul_mat_id {dtype.name}"


def kv(dtype: DType) -> str:
    """The tag of a KV cache of `dtype` (the block-quantized types share their kernels' signatures)."""
    return f"kv {'blocks' if dtype.is_quantized else dtype.name}"


@dataclass(frozen=True)
class Warm:
    """A one-node graph builder `(leafs) -> output` and the tags a model must have for its kernels to
    be compiled up front (none: every model)."""

    build: Callable = field(compare=False)
    needs: frozenset[str]
    key: str  # names its marker: the builder's function and the arguments bound into it

    def wanted(self, have: frozenset[str]) -> bool:
        return self.needs <= have


def _key(build: Callable, needs: frozenset[str]) -> str:
    """A name for a builder that is the same in every process: its function, bound defaults and tags."""
    what = f"{build.__module__}.{build.__qualname__}{getattr(build, '__defaults__', None)!r}{sorted(needs)}"
    return hashlib.sha256(what.encode()).hexdigest()[:20]


WARMS: list[Warm] = []  # every registered builder, in registration order


def warms(build: Callable | None = None, *, needs: Iterable[str] = ()):
    """Register a one-node graph builder `(leafs) -> output` whose kernels the warm-up compiles for models
    with all of `needs` (tags made by product, experts, rows, kv, THREADS). As a decorator: `@warms` or
    `@warms(needs=...)`; returns the builder."""
    def register(fn: Callable) -> Callable:
        tagged = frozenset(needs)
        WARMS.append(Warm(fn, tagged, _key(fn, tagged)))
        return fn
    return register if build is None else register(build)


def readonly(leafs, name: str, dtype: DType, data: np.ndarray) -> Tensor:
    """A weight holding data's values in read-only memory, as a memory-mapped file gives them
    (numba compiles read-only arrays as a type of their own)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy()
    raw.flags.writeable = False
    return leafs.ctx.from_bytes(name, dtype, data.shape, raw)
