"""First-run compilation of the CPU kernels a model needs: small one-node graphs run through the real
CPU backend (so each kernel compiles for exactly the argument types it meets later, read-only
memory-mapped weights included), once per machine and kind of use.

Each graph builder is registered with the tags a model must have for its kernels to be worth
compiling up front (`warms(build, needs=...)`): a product of a weight type in its stored or
repacked rows, with 8-bit or f32 activations (`product`), rows looked up from a table of a type
(`rows`), a KV cache type (`kv`), more than one thread (THREADS); builders without tags serve every
model. A model's tags (`tags`) come from its loaded weights, so SmolLM2 compiles its few product
kernels, not every type's. A kernel no builder warmed still works: numba compiles it on its first
call, later, without the progress bar.

numba keeps the machine code in its on-disk cache; a marker file per builder (in a directory named
for this version of the kernels) says it ran, so a later model compiles only the builders its own
tags add, and later processes skip the rest and load each kernel from the cache on its first call.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ggrun.core import ops
from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor, new_tensor

Progress = Callable[[int, int], None]

K = 256  # one k-quant super-block, eight legacy blocks
WEIGHT_TYPES = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0, DType.Q2_K, DType.Q3_K,
                DType.Q4_K, DType.Q5_K, DType.Q6_K, DType.F16, DType.BF16, DType.F32)

THREADS = "threads"  # the kernels run on more than one thread: their parallel variants are met


def product(dtype: DType | None, packed: bool, act_quant: bool) -> str:
    """The tag of products with weight matrices of `dtype` (None: of any type) read in their repacked
    rows (`packed`, matmul.REPACKED) or as stored, against activations quantized to 8-bit blocks
    (`act_quant`, llama numerics) or in f32."""
    return f"mul_mat {dtype.name if dtype else 'any'} {'packed' if packed else 'stored'} {'q8' if act_quant else 'f32'}"


def rows(dtype: DType) -> str:
    """The tag of row lookups (get_rows: the token embedding) from a table stored as `dtype`."""
    return f"get_rows {dtype.name}"


def kv(dtype: DType) -> str:
    """The tag of a KV cache of `dtype` (the block-quantized types share their kernels' signatures)."""
    return f"kv {'blocks' if dtype.is_quantized else dtype.name}"


def tags(matrices: Iterable[Tensor], tables: Iterable[Tensor], kv_types: Iterable[DType], threads: int) -> frozenset[str]:
    """A model's tags: the weights its products read (as loaded: act_quant and repacked rows in their
    params), the tables it looks rows up in, its KV cache types, and whether kernels run threaded."""
    from ggrun.core.backends.cpu.matmul import REPACKED

    found = {kv(d) for d in kv_types} | {rows(t.dtype) for t in tables}
    for t in matrices:
        packed, act_quant = t.params.get(REPACKED) is not None, "act_quant" in t.root.params
        found |= {product(t.dtype, packed, act_quant), product(None, packed, act_quant)}
    if threads > 1:
        found.add(THREADS)
    return frozenset(found)


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
    with all of `needs` (tags made by product, rows, kv, THREADS). As a decorator: `@warms` or
    `@warms(needs=...)`; returns the builder."""
    def register(fn: Callable) -> Callable:
        tagged = frozenset(needs)
        WARMS.append(Warm(fn, tagged, _key(fn, tagged)))
        return fn
    return register if build is None else register(build)


def selected(have: frozenset[str]) -> list[Warm]:
    """The builders a model with tags `have` needs."""
    return [w for w in WARMS if w.wanted(have)]


def marker_dir() -> Path:
    """Where the markers of builders run with this version of the CPU kernels live (beside numba's
    cache): named by numba's version, a digest of the kernel sources and the instruction set chosen."""
    import numba

    from ggrun.core.backends.cpu import quant

    src = Path(__file__).parent
    digest = hashlib.sha256(f"{quant.SIMD} {os.environ.get('GGRUN_CPU_ISA', '')}".encode())
    for f in sorted(src.glob("*.py")):
        digest.update(f.read_bytes())
    return Path(numba.config.CACHE_DIR) / f"compiled-{numba.__version__}-{digest.hexdigest()[:16]}"


def pending(have: frozenset[str]) -> list[Warm]:
    """The builders a model with tags `have` needs that have not run on this machine yet."""
    try:
        done = set(os.listdir(marker_dir()))
    except OSError:
        done = set()
    return [w for w in selected(have) if w.key not in done]


def compile_warms(backend, warms: list[Warm], progress: Progress | None = None, helpers: int = 0) -> None:
    """Run each builder's graph on `backend` (compiling its kernels), marking each as done when it ran.

    With `helpers`, that many processes of their own (compile_worker.py) share the work: numba compiles
    one kernel at a time in a process (it holds a lock and the GIL), and the kernels they compile reach
    this one through numba's on-disk cache. Builders go by family (those made by one function, which
    share most of their kernels), this process taking families from the front of the list and the
    helpers from the back, each claiming a family before it starts it; whatever a helper left undone
    (it failed or was stopped) runs here after it ends."""
    where = marker_dir()
    where.mkdir(parents=True, exist_ok=True)
    keys = {w.key for w in warms}

    def advance() -> None:
        if progress is not None:
            progress(len(keys & set(os.listdir(where))), len(warms))

    groups = families(warms)
    if helpers < 1 or len(groups) < 2:
        for w in warms:
            _run_marked(backend, w, where)
            advance()
        return
    from ggrun.core.backends.cpu import compile_worker

    with compile_worker.Helpers(helpers, [w.key for w in warms]) as claims:
        for group in groups:
            if claims.claim(group[0].key):
                for w in group:
                    _run_marked(backend, w, where)
                    advance()
    done = set(os.listdir(where))
    for w in warms:
        if w.key not in done:
            _run_marked(backend, w, where)
            advance()


def families(warms: list[Warm]) -> list[list[Warm]]:
    """warms grouped by the function that builds them (a loop's lambdas share theirs), in order."""
    groups: dict[object, list[Warm]] = {}
    for w in warms:
        groups.setdefault(getattr(w.build, "__code__", w.build), []).append(w)
    return list(groups.values())


def _run_marked(backend, warm: Warm, where: Path) -> None:
    run(backend, warm)
    (where / warm.key).touch()


def run(backend, warm: Warm) -> None:
    """Build, plan and compute one builder's graph on `backend` (its kernels compile or load on the way)."""
    from ggrun.core.graph import build_graph
    from ggrun.core.sched import Scheduler

    leafs = _Leafs(backend)
    sched = Scheduler([backend])
    sg = sched.schedule(build_graph([warm.build(leafs)]))
    sched.alloc(sg)
    for t, data in leafs.feeds.items():
        sched.set_tensor(t, data)
    sched.compute(sg)


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
    if act_quant:
        w.params["act_quant"] = "q8_k" if dtype.name.endswith("_K") else "q8_0"
    if repacked:
        leafs.ctx.prepare_weight(w)
    x = leafs.input("x", np.ones((n_tokens, K), np.float32))
    return ops.mul_mat(w, x)


def _get_rows(leafs, dtype: DType) -> Tensor:
    return ops.get_rows(_weight(leafs, dtype, 4), leafs.input("ids", np.array([1, 3], np.int32)))


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


# products of every weight type: decode steps, short and long prompts (each may take its own path),
# with 8-bit activations (llama numerics, quantized types only) or f32, in repacked rows (quantized
# matrices, at load) or as stored, on one thread or split over all of them
for _dtype in WEIGHT_TYPES:
    for _n in (1, 64, 300):
        for _act_quant in (True, False) if _dtype.is_quantized else (False,):
            for _packed in (True, False) if _dtype.is_quantized else (False,):
                for _large in (False, True):
                    warms(lambda lf, d=_dtype, n=_n, q=_act_quant, r=_packed, g=_large: _product(lf, d, n, q, r, g),
                          needs={product(_dtype, _packed, _act_quant)} | ({THREADS} if _large else set()))
    warms(lambda lf, d=_dtype: _get_rows(lf, d), needs={rows(_dtype)})
