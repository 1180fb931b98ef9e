"""The backend interface: buffers (real arenas), op support, kernels over planned memory,
and copies in, out and across backends.

A backend reads and writes only its own buffers; data reaches another backend only
through an explicit copy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ggrun.core.errors import RuntimeFailure
from ggrun.core.tensor import Tensor


@dataclass(frozen=True)
class BufferType:
    alignment: int
    max_size: int


class Buffer:
    """One arena of a backend: `storage` is a flat uint8 array (numpy or cupy).

    A virtual buffer has a size but no storage: it lets `ggrun measure` place weights and
    the KV cache on backends and plan graphs over them without taking their memory.
    """

    def __init__(self, backend: "Backend", storage: Any, usage: str, size: int | None = None) -> None:
        self.backend = backend
        self.storage = storage
        self.usage = usage
        self._size = int(storage.nbytes) if storage is not None else int(size or 0)

    @property
    def size(self) -> int:
        return self._size

    def clear(self, value: int = 0) -> None:
        """Fill every byte with `value` (by its backend, which knows its device)."""
        if self.storage is not None:
            self.backend.fill_bytes(self, 0, self.size, value)

    def __repr__(self) -> str:
        return f"Buffer({self.backend.name}, {self.usage}, {self.size} bytes)"


class Backend(ABC):
    """A device that owns buffers and runs kernels on tensors placed in them."""

    name: str = "?"
    device: str = "?"
    buffer_type = BufferType(alignment=64, max_size=1 << 40)
    # weights stay in their GGUF block formats here; a backend without kernels for them gets f32
    stores_blocks: bool = False

    @abstractmethod
    def alloc_buffer(self, size: int, usage: str) -> Buffer: ...

    def alloc_zeroed(self, size: int, usage: str) -> Buffer:
        """A buffer whose every byte is zero (the KV cache starts so, so masked cells hold no NaN
        garbage); a backend that can get zeroed memory without writing it overrides this."""
        buf = self.alloc_buffer(size, usage)
        buf.clear()
        return buf

    def fill_bytes(self, buf: Buffer, offset: int, nbytes: int, value: int) -> None:
        """Set nbytes of buffer buf (this backend's) from offset to `value`, in order with the work given to
        this backend. Here: the host array in place."""
        buf.storage[offset:offset + nbytes] = value

    def read_bytes(self, buf: Buffer, offset: int, nbytes: int) -> np.ndarray:
        """A host copy of nbytes of buffer buf (this backend's) from offset, after the work given so far."""
        return np.array(buf.storage[offset:offset + nbytes])

    @abstractmethod
    def supports_op(self, node: Tensor) -> bool: ...

    def prepare_weight(self, t: Tensor, store: Any = None) -> int:
        """Re-lay a weight once at load for this backend's kernels (like ggml's CPU "repacked"
        buffers), keeping the stored bytes as they are; returns the bytes it added (for a weight
        without memory, the bytes it would add). `store` is what `prepared_store` gave for the
        weight's file, if anything. None by default."""
        return 0

    def prepared_store(self, source: str) -> Any:
        """Where the weights this backend re-lays for model file `source` are kept between runs
        (an object with `save()`, passed to prepare_weight), or None: they are made at every load."""
        return None

    def scratch_bytes(self, node: Tensor) -> int:
        """Work space node's kernel needs beside its result (planned by the allocator); none by default."""
        return 0

    @abstractmethod
    def array(self, t: Tensor) -> Any:
        """The native array over t's bytes in this backend's memory (fails for foreign memory)."""

    @abstractmethod
    def compute(self, nodes: list[Tensor]) -> None:
        """Run the kernels of `nodes`, each writing into its planned memory."""

    @abstractmethod
    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        """Copy host data into t."""

    @abstractmethod
    def get_tensor(self, t: Tensor) -> np.ndarray:
        """A host copy of t's elements."""

    def get_checked(self, t: Tensor) -> tuple[np.ndarray, bool]:
        """A host copy of t's elements and whether every one is finite (each step's logits are checked):
        a backend may check on its device while the values travel. Here: get_tensor, then all_finite."""
        out = self.get_tensor(t)
        return out, all_finite(out)

    def copy_tensor(self, src: Tensor, dst: Tensor) -> None:
        """Copy src (on any backend) into dst (on this backend), through the host."""
        self.set_tensor(dst, src.root.buffer.backend.get_tensor(src))

    def plan_copies(self, pairs: list[tuple[Tensor, Tensor]]) -> Callable[[], None]:
        """What copies a split's inputs, the (src, dst) pairs, before each run of the split: made once per
        plan (the pairs stay the same while it holds), so that a backend may resolve them once and copy
        them together. Here: copy_tensor for each pair."""
        def copy() -> None:
            for src, dst in pairs:
                self.copy_tensor(src, dst)
        return copy

    def record_event(self) -> Any:
        """A marker after the work issued to this backend so far (a CUDA event on its stream), for
        another backend, or this one, to wait for; None where work is done when its call returns."""
        return None

    def wait_event(self, event: Any) -> None:
        """Make the work issued to this backend from now on wait for `event` (from any backend)."""

    # backends that draw on one memory (the host's RAM) share a pool name; each GPU is a pool of its own
    memory_pool: str = "?"

    def free_memory(self) -> int | None:
        """Bytes this backend's memory pool can still give, or None when it cannot tell."""
        return None

    def address(self, arr: Any) -> int:
        """Device address of an array's first element (used to check placements)."""
        return int(arr.__array_interface__["data"][0])

    def check_owned(self, t: Tensor) -> None:
        root = t.root
        if root.buffer is None:
            raise RuntimeFailure(f"{self.name}: tensor {t.describe()} has no memory (graph not allocated)")
        if root.buffer.backend is not self:
            raise RuntimeFailure(
                f"{self.name}: tensor {t.describe()} lives on {root.buffer.backend.name}; "
                "it must be copied before this backend reads it")

    def __repr__(self) -> str:
        return f"<backend {self.name}: {self.device}>"


def all_finite(values: np.ndarray) -> bool:
    """np.isfinite(values).all() for logits, read in one pass where it can: float32 values all finite
    have a finite sum (einsum's, which makes no temporary), and NaN or infinity in any element makes the
    sum non-finite. Only a non-finite sum (a fault, or finite values so large that it overflows) has
    every element checked."""
    if values.dtype == np.float32 and np.isfinite(np.einsum("i->", values.reshape(-1))):
        return True
    return bool(np.isfinite(values).all())
