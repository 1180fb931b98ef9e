"""The Tensor record: shape, dtype, strides, the op that produces it, and (once placed) its memory.

A tensor never holds data itself; its bytes live in a backend Buffer at `offset`. A view
records its root tensor (`view_src`, never itself a view) and a byte offset into it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ggrun.core.dtypes import DType

if TYPE_CHECKING:
    from ggrun.core.backends.base import Buffer


def contiguous_strides(shape: tuple[int, ...], dtype: DType) -> tuple[int, ...]:
    """Byte strides of a C-contiguous tensor.

    Quantized rows are stored in blocks, so their innermost stride is 0 (never indexed
    element-wise) and the next one is the byte size of a whole row.
    """
    if not shape:
        return ()
    strides = [0] * len(shape)
    strides[-1] = 0 if dtype.is_quantized else dtype.itemsize
    step = dtype.row_bytes(shape[-1])
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = step
        step *= shape[i]
    return tuple(strides)


@dataclass(eq=False)
class Tensor:
    """A node or leaf of a compute graph. Identity is object identity (tensors are hashable)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    op: str | None = None
    srcs: tuple["Tensor", ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    is_input: bool = False
    is_output: bool = False
    is_weight: bool = False
    view_src: "Tensor | None" = None
    view_offset: int = 0
    buffer: "Buffer | None" = None
    offset: int = 0
    scratch: "Tensor | None" = field(default=None, repr=False)  # a node's planned work space, if its kernel asks one
    _array: Any = field(default=None, repr=False)

    __hash__ = object.__hash__

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes this tensor's elements span (its own storage size when contiguous)."""
        if not self.shape:
            return self.dtype.type_size
        if self.dtype.is_quantized:
            return self.dtype.row_bytes(self.shape[-1]) * math.prod(self.shape[:-1])
        if self.n_elements == 0:
            return 0
        return self.dtype.itemsize + sum((d - 1) * s for d, s in zip(self.shape, self.strides))

    @property
    def is_contiguous(self) -> bool:
        return self.strides == contiguous_strides(self.shape, self.dtype)

    @property
    def root(self) -> "Tensor":
        """The tensor that owns the memory this one lives in (itself unless a view)."""
        return self.view_src if self.view_src is not None else self

    @property
    def data_offset(self) -> int:
        """Byte offset of element 0 inside the root's buffer."""
        return self.root.offset + self.view_offset

    def place(self, buffer: "Buffer", offset: int) -> None:
        """Give this (non-view) tensor memory; cached array views are dropped."""
        assert self.view_src is None, f"view {self.name} cannot be placed; its root {self.root.name} is"
        self.buffer = buffer
        self.offset = offset
        self._array = None

    def describe(self) -> str:
        """Short text naming the tensor, e.g. `attn_q-3 f32[7, 576]`."""
        return f"{self.name} {self.dtype}{list(self.shape)}"

    def __repr__(self) -> str:
        return f"Tensor({self.describe()}, op={self.op})"


def new_tensor(name: str, dtype: DType, shape: tuple[int, ...], **kw: Any) -> Tensor:
    """A fresh contiguous tensor with no memory (a deferred tensor unless placed later)."""
    shape = tuple(int(d) for d in shape)
    return Tensor(name=name, dtype=dtype, shape=shape, strides=contiguous_strides(shape, dtype), **kw)
