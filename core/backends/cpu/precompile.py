"""First-run compilation of the CPU kernels a model needs: the builders registered in warmup.py (small
one-node graphs) run through the real CPU backend (so each kernel compiles for exactly the argument
types it meets later, read-only memory-mapped weights included), once per machine and kind of use.

A model's tags (`tags`) come from its loaded weights, so SmolLM2 compiles its few product kernels, not
every type's. The builders of products and row lookups, which serve every weight type, are registered
here; the other kernel modules register their own.

numba keeps the machine code in its on-disk cache; a marker file per builder (in a directory named
for this version of the kernels) says it ran, so a later model compiles only the builders its own
tags add, and later processes skip the rest and load each kernel from the cache on its first call.
On a machine with cores to spare, helper processes (compile_worker.py) compile beside this one.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import numba
import numpy as np

from ggrun.core import ops
from ggrun.core.backends.cpu import jit
from ggrun.core.backends.cpu.quant import codes
from ggrun.core.backends.cpu.matmul import PARALLEL_MIN_BYTES, REPACKED
from ggrun.core.backends.cpu.warmup import THREADS, WARMS, Warm, kv, product, rows, warms
from ggrun.core.context import ImmediateContext
from ggrun.core.dtypes import DType
from ggrun.core.graph import build_graph
from ggrun.core.quants import vec_dot_blocks
from ggrun.core.sched import Scheduler
from ggrun.core.tensor import Tensor, new_tensor

Progress = Callable[[int, int], None]
WORKER = "ggrun.core.backends.cpu.compile_worker"  # a helper process runs this module
K = 256  # one k-quant super-block, eight legacy blocks
WEIGHT_TYPES = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q8_0, DType.Q2_K, DType.Q3_K,
                DType.Q4_K, DType.Q5_K, DType.Q6_K, DType.IQ4_NL, DType.IQ4_XS, DType.MXFP4, DType.F16, DType.BF16,
                DType.F32)


def tags(matrices: Iterable[Tensor], tables: Iterable[Tensor], kv_types: Iterable[DType], threads: int) -> frozenset[str]:
    """A model's tags: the weights its products read (as loaded: act_quant and repacked rows in their
    params), the tables it looks rows up in, its KV cache types, and whether kernels run threaded."""
    found = {kv(d) for d in kv_types} | {rows(t.dtype) for t in tables}
    for t in matrices:
        packed, act_quant = t.params.get(REPACKED) is not None, "act_quant" in t.root.params
        found |= {product(t.dtype, packed, act_quant), product(None, packed, act_quant)}
    if threads > 1:
        found.add(THREADS)
    return frozenset(found)


def selected(have: frozenset[str]) -> list[Warm]:
    """The builders a model with tags `have` needs."""
    return [w for w in WARMS if w.wanted(have)]


def marker_dir() -> Path:
    """Where the markers of builders run with this version of the CPU kernels live (beside numba's
    cache): named by numba's version, a digest of the kernel sources and the instruction set chosen."""
    src = Path(__file__).parent
    digest = hashlib.sha256(f"{codes.SIMD} {os.environ.get('GGRUN_CPU_ISA', '')}".encode())
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
    with Helpers(helpers, [w.key for w in warms]) as claims:
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


def claim(claims: Path, key: str) -> bool:
    """Whether this process got the family whose first builder is `key` (no other process has it)."""
    try:
        os.close(os.open(claims / key, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class Helpers:
    """`n` helper processes over builders `keys`, for a `with` block; claim() claims for this process.
    Leaving the block waits for the helpers (stops them if the block raised) and removes the claims."""

    def __init__(self, n: int, keys: list[str]) -> None:
        self.n = n
        self.keys = keys
        self.claims = Path()
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Helpers":
        self.claims = Path(tempfile.mkdtemp(prefix="ggrun-compile-"))
        cmd = [sys.executable, "-m", WORKER, str(self.claims), str(marker_dir()), str(jit.threads())]
        for _ in range(self.n):
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            proc.stdin.write("\n".join(self.keys).encode())
            proc.stdin.close()
            self.procs.append(proc)
        return self

    def claim(self, key: str) -> bool:
        return claim(self.claims, key)

    def __exit__(self, kind, *rest) -> None:
        for proc in self.procs:
            if kind is not None:
                proc.terminate()
            proc.wait()
        shutil.rmtree(self.claims, ignore_errors=True)


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


def _product(leafs, dtype: DType, n_tokens: int, act_quant: bool, repacked: bool, large: bool) -> Tensor:
    # a large product has enough weight rows (for its tokens) that the kernels split them over threads
    w = _weight(leafs, dtype, 8 * (PARALLEL_MIN_BYTES // (8 * dtype.row_bytes(K) * n_tokens) + 1) if large else 16)
    if act_quant:
        w.params["act_quant"] = vec_dot_blocks(dtype.name)
    if repacked:
        leafs.ctx.prepare_weight(w)
    x = leafs.input("x", np.ones((n_tokens, K), np.float32))
    return ops.mul_mat(w, x)


def _get_rows(leafs, dtype: DType) -> Tensor:
    return ops.get_rows(_weight(leafs, dtype, 4), leafs.input("ids", np.array([1, 3], np.int32)))


class _Leafs:
    """Leafs on the CPU backend: weights in an immediate context, inputs fed after planning."""

    def __init__(self, backend) -> None:
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
