"""The CUDA backend: cupy arenas on one NVIDIA GPU, running the shared array kernels with cupy.

Like every backend it reads and writes only its own buffers; host data and other
backends' tensors arrive through explicit copies.
"""
from __future__ import annotations

import cupy
import numpy as np

from ggrun.core.backends.array_backend import ArrayBackend, storage_dtype
from ggrun.core.backends.base import Buffer, BufferType
from ggrun.core.tensor import Tensor


def describe_device(index: int) -> str:
    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"{name} ({props['totalGlobalMem'] / 2**30:.0f} GiB), cupy {cupy.__version__}"


class CUDABackend(ArrayBackend):
    name = "CUDA"
    buffer_type = BufferType(alignment=256, max_size=1 << 40)
    xp = cupy

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.device = describe_device(index)
        self._dev = cupy.cuda.Device(index)

    @property
    def memory_pool(self) -> str:
        return f"{self.name}{self.index}"

    def free_memory(self) -> int | None:
        """Free device memory plus what cupy's pool holds unused (it hands that out first)."""
        with self._dev:
            free, _ = cupy.cuda.runtime.memGetInfo()
            return int(free) + int(cupy.get_default_memory_pool().free_bytes())

    def device_context(self):
        return self._dev

    def alloc_buffer(self, size: int, usage: str) -> Buffer:
        with self._dev:
            return Buffer(self, cupy.empty(size, dtype=cupy.uint8), usage)

    def view_array(self, t: Tensor, storage) -> "cupy.ndarray":
        if t.dtype.is_quantized:
            return storage[t.data_offset:t.data_offset + t.nbytes]
        return cupy.ndarray(t.shape, dtype=storage_dtype(t), memptr=storage.data + t.data_offset, strides=t.strides)

    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        dst = self.array(t)
        with self._dev:
            dst[...] = cupy.asarray(np.ascontiguousarray(data)).reshape(dst.shape)

    def get_tensor(self, t: Tensor) -> np.ndarray:
        with self._dev:
            return cupy.asnumpy(self.array(t))

    def address(self, arr) -> int:
        return int(arr.data.ptr)
