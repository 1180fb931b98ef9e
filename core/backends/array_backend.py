"""A backend whose kernels are the shared array kernels (core/backends/kernels.py) run with
an array module (`xp`: numpy or cupy). Subclasses supply arenas and array views.

Each placed tensor's array view is made once and cached on the tensor; kernel calls are
resolved once per plan (`prepare`) and replayed while the plan holds (graph reuse).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np

from ggrun.core.backends.base import Backend
from ggrun.core.backends.kernels import KERNELS
from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor


class ArrayBackend(Backend):
    xp: Any = None

    def view_array(self, t: Tensor, storage: Any) -> Any:
        """An array over t's elements inside `storage`, this backend's flat uint8 arena."""
        raise NotImplementedError

    def device_context(self):
        """Context the kernels run in (a cupy Device for a GPU)."""
        return nullcontext()

    def supports_op(self, node: Tensor) -> bool:
        return node.op in KERNELS

    def array(self, t: Tensor) -> Any:
        self.check_owned(t)
        root = t.root
        cached = t._array
        # placing a root again drops its own cache but not its views': check where each was made
        if cached is not None and cached[0] is root.buffer and cached[1] == root.offset:
            return cached[2]
        arr = self.view_array(t, root.buffer.storage)
        t._array = (root.buffer, root.offset, arr)
        return arr

    def prepare(self, nodes: list[Tensor]) -> list[tuple]:
        """Kernel calls with their arrays resolved once, to be run many times (graph reuse)."""
        arr = self.array
        return [(KERNELS[n.op], n, arr(n), [arr(s) for s in n.srcs]) for n in nodes]

    def run_prepared(self, calls: list[tuple]) -> None:
        xp = self.xp
        with self.device_context():
            for fn, node, out, srcs in calls:
                fn(xp, node, out, srcs)

    def compute(self, nodes: list[Tensor]) -> None:
        self.run_prepared(self.prepare(nodes))


def storage_dtype(t: Tensor) -> np.dtype:
    """The array dtype that holds t's elements (bf16 is kept as uint16)."""
    return np.dtype(np.uint16) if t.dtype is DType.BF16 else t.dtype.np_dtype
