"""First-run compilation of the CPU kernels: small one-node graphs of every op and stored type the
models use, run through the real CPU backend (so each kernel compiles for exactly the argument
types it meets later, read-only memory-mapped weights included), once per machine.

numba keeps the machine code in its on-disk cache; a marker file beside it says that the whole
set was compiled by this version of the kernels, so later processes skip the warm-up and load
each kernel from the cache on its first call.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import numpy as np

from ggrun.core import ops
from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor, new_tensor

Progress = Callable[[int, int], None]

K = 256  # one k-quant super-block, eight legacy blocks
WEIGHT_TYPES = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0, DType.Q2_K, DType.Q3_K,
                DType.Q4_K, DType.Q5_K, DType.Q6_K, DType.F16, DType.BF16, DType.F32)


def marker() -> Path:
    """The file that says this version of the CPU kernels is compiled on this machine."""
    import numba

    src = Path(__file__).parent
    digest = hashlib.sha256()
    for f in sorted(src.glob("*.py")):
        digest.update(f.read_bytes())
    return Path(numba.config.CACHE_DIR) / f"compiled-{numba.__version__}-{digest.hexdigest()[:16]}"


def needs_compile() -> bool:
    return not marker().exists()


def _graphs() -> list[Callable]:
    """Builders of one-node graphs: (leafs) -> output tensor, for every op and type in use."""
    builders = []
    for dtype in WEIGHT_TYPES:
        for n_tokens in (1, 64, 300):  # decode, short and long prompts: each takes its own path
            for act_quant in (True, False):
                for repacked in (True, False):  # layer matrices are repacked at load; a tied head is not
                    for large in (False, True):  # small products run on one thread, large ones on all
                        builders.append(lambda lf, d=dtype, n=n_tokens, q=act_quant, r=repacked, g=large:
                                        _product(lf, d, n, q, r, g))
        builders.append(lambda lf, d=dtype: ops.get_rows(_weight(lf, d, 4), lf.input("ids", np.array([1, 3], np.int32))))
    return builders


def _weight(leafs, dtype: DType, rows: int) -> Tensor:
    """A read-only weight of zero bytes (valid blocks of every type), as a memory map gives them."""
    nbytes = dtype.row_bytes(K) * rows
    raw = np.zeros(nbytes, dtype=np.uint8)
    raw.flags.writeable = False
    return leafs.ctx.from_bytes(f"w_{dtype}", dtype, (rows, K), raw)


def readonly(leafs, name: str, dtype: DType, data: np.ndarray) -> Tensor:
    """A weight holding data's values in read-only memory, as a memory-mapped file gives them
    (numba compiles read-only arrays as a type of their own)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy()
    raw.flags.writeable = False
    return leafs.ctx.from_bytes(name, dtype, data.shape, raw)


def _product(leafs, dtype: DType, n_tokens: int, act_quant: bool, repacked: bool, large: bool) -> Tensor:
    from ggrun.core.backends.cpu.matmul import PARALLEL_MIN_BYTES

    # a large product has enough weight rows (for its tokens) that the kernels split them over threads
    w = _weight(leafs, dtype, 8 * (PARALLEL_MIN_BYTES // (8 * dtype.row_bytes(K) * n_tokens) + 1) if large else 16)
    if act_quant and dtype.is_quantized:
        w.params["act_quant"] = "q8_k" if dtype.name.endswith("_K") else "q8_0"
    if repacked:
        leafs.ctx.prepare_weight(w)
    x = leafs.input("x", np.ones((n_tokens, K), np.float32))
    return ops.mul_mat(w, x)


class _Leafs:
    """Leafs on the CPU backend: weights in an immediate context, inputs fed after planning."""

    def __init__(self, backend) -> None:
        from ggrun.core.context import ImmediateContext

        self.ctx = ImmediateContext(backend)
        self.feeds: dict[Tensor, np.ndarray] = {}

    def input(self, name: str, data: np.ndarray) -> Tensor:
        dtype = DType.I32 if data.dtype == np.int32 else DType.F32
        t = new_tensor(name, dtype, data.shape, is_input=True)
        self.feeds[t] = data
        return t


def compile_all(backend, progress: Progress | None = None) -> None:
    """Run every warm-up graph on `backend` (compiling its kernels), then write the marker."""
    from ggrun.core.graph import build_graph
    from ggrun.core.sched import Scheduler

    builders = _graphs() + list(EXTRA)
    for i, build in enumerate(builders):
        leafs = _Leafs(backend)
        sched = Scheduler([backend])
        sg = sched.schedule(build_graph([build(leafs)]))
        sched.alloc(sg)
        for t, data in leafs.feeds.items():
            sched.set_tensor(t, data)
        sched.compute(sg)
        if progress is not None:
            progress(i + 1, len(builders))
    path = marker()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


EXTRA: list[Callable] = []  # one-node graph builders that kernel modules add for their own ops


def warms(build: Callable) -> Callable:
    """Register a one-node graph builder `(leafs) -> output` whose kernels the warm-up compiles."""
    EXTRA.append(build)
    return build
