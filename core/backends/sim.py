"""`sim`: a stand-in device backend for tests and demonstrations. It runs the numpy kernels
but behaves like a separate device: its own arenas and alignment (256), no zero-copy
wrapping of host memory, a configurable set of refused ops, and counters of the bytes
copied in and out.

It fails loudly when asked to read memory of another backend, so a missing copy in the
scheduler cannot go unnoticed. Enabled with GGRUN_SIM_DEVICE=1 (one device, `SIM`) or =N (N
devices, SIM0..SIM{N-1}: the stand-ins for several GPUs of one host). Between two of them a copy
goes straight from one arena to the other, as between GPUs with peer access.
"""
from __future__ import annotations

import os

import numpy as np

from ggrun.core.backends.base import BufferType
from ggrun.core.backends.host import HostArrayBackend
from ggrun.core.tensor import Tensor


class SimBackend(HostArrayBackend):
    name = "SIM"
    buffer_type = BufferType(alignment=256, max_size=1 << 40)
    wrap = None  # host arrays are always copied in, as to a real device

    def __init__(self, refuse: frozenset[str] | None = None, name: str | None = None) -> None:
        if name is not None:
            self.name = name
        self.device = "stand-in device (numpy kernels, own memory)"
        if refuse is None:
            refuse = frozenset(x for x in os.environ.get("GGRUN_SIM_REFUSE", "").split(",") if x)
        self.refuse = frozenset(refuse)
        self.bytes_in = 0
        self.bytes_out = 0

    def supports_op(self, node: Tensor) -> bool:
        return node.op not in self.refuse and super().supports_op(node)

    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        super().set_tensor(t, data)
        self.bytes_in += t.nbytes

    def get_tensor(self, t: Tensor) -> np.ndarray:
        self.bytes_out += t.nbytes
        return super().get_tensor(t)

    def copy_tensor(self, src: Tensor, dst: Tensor) -> None:
        """Another stand-in device's tensor arrives arena to arena (device to device); anything else
        through the host, as for any backend."""
        owner = src.root.buffer.backend
        if not isinstance(owner, SimBackend) or owner is self:
            super().copy_tensor(src, dst)
            return
        out = self.array(dst)
        out[...] = owner.array(src).reshape(out.shape)
        owner.bytes_out += dst.nbytes
        self.bytes_in += dst.nbytes

    def reset_counters(self) -> None:
        self.bytes_in = self.bytes_out = 0
