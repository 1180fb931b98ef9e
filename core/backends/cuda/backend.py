"""The CUDA backend: device arenas on one NVIDIA GPU, weights in their GGUF blocks, compiled
kernels (core/backends/cuda/*.cu) bound once per plan and replayed as a CUDA graph while the
engine reuses the graph, all on one stream; host copies go through pinned staging memory.

Each GPU is a backend of its own (CUDA0, CUDA1, ...): every call that allocates, fills, copies,
launches, records an event or captures a graph runs with its own device current (cupy's Device
context) and on its stream, so nothing assumes device 0. A tensor from another GPU arrives on this GPU's
stream, device to device where the two have peer access, else through this backend's pinned staging
memory; events order the copy after the source's kernels that wrote the tensor, and the source's later
kernels after the copy (never a wait for a whole stream). The staging memory is a ring whose
regions each carry the event after the copy that reads them: a region is handed out again once that
event has passed, never after a wait for the whole stream. A CUDA error becomes one line naming the
device (DeviceFailure).

Like every backend it reads and writes only its own buffers; host data and other backends'
tensors arrive through explicit copies. Ops without a kernel here run the shared array
kernels with cupy (outside any CUDA graph); the scheduler sends what that cannot run
(block-quantized operands of an unknown type) to the CPU.
"""
from __future__ import annotations

import os
from collections import deque
from functools import partial, wraps
from typing import Callable

import cupy
import numpy as np

from ggrun.core.backends.array_backend import storage_dtype
from ggrun.core.backends.base import Backend, Buffer, BufferType
from ggrun.core.backends.cuda import blas, handoff, launch, uploads
from ggrun.core.backends.cuda import experts as _experts  # noqa: F401  (registers the experts' kernels)
from ggrun.core.backends.cuda import matmul as _matmul  # registers kernels
from ggrun.core.backends.cuda import ops as _ops  # noqa: F401  (registers kernels)
from ggrun.core.backends.cuda import sample as _sample  # noqa: F401  (registers ops.sample's kernel)
from ggrun.core.backends.cuda.binding import FUSIONS, TABLE, Step, launches_of, nothing
from ggrun.core.backends.cuda.graphs import Prepared
from ggrun.core.backends.cuda.launch import TICKETS
from ggrun.core.backends.cuda.module import TYPE_IDS, kernel
from ggrun.core.backends.kernels import KERNELS
from ggrun.core.dtypes import DType
from ggrun.core.errors import DeviceFailure
from ggrun.core.tensor import Tensor

STAGING_BYTES = 16 << 20  # pinned host memory for copies; larger copies go straight from pageable memory
# results up to this size come back in pinned memory of cupy's pool (returned to it when the array goes),
# saving the copy out of staging: half a megabyte of logits a decode step
PINNED_RESULT_BYTES = 1 << 20
FETCH_BLOCKS = 32  # blocks of fetch_checked: as fast as 132 or 528 for 128k logits (H100)
NO_FLAGS = bytes(4 * FETCH_BLOCKS)  # the flags of fetch_checked when every value is finite
H2D, D2H = 1, 2  # cudaMemcpyKind
PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
# the ops whose kernels read GGUF blocks
BLOCK_OPS = ("mul_mat", "mul_mat_multi", "mul_mat_glu", "get_rows", "mul_mat_id")


def _device_errors() -> tuple[type[BaseException], ...]:
    """What cupy, cuBLAS and the driver raise when a device fails a call."""
    names = (("runtime", "CUDARuntimeError"), ("driver", "CUDADriverError"), ("memory", "OutOfMemoryError"),
             ("cublas", "CUBLASError"), ("compiler", "CompileException"))
    found = [getattr(getattr(cupy.cuda, mod, None), cls, None) for mod, cls in names]
    return tuple(e for e in found if isinstance(e, type)) + (launch.LaunchError, blas.BlasError)


DEVICE_ERRORS = _device_errors()


def on_device(fn: Callable) -> Callable:
    """A backend method whose CUDA errors become one DeviceFailure line naming the backend's GPU."""
    @wraps(fn)
    def call(self: "CUDABackend", *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except DEVICE_ERRORS as err:
            raise DeviceFailure(f"{self.name} ({self.device})", f"{type(err).__name__}: {err}") from err
    return call


def describe_device(index: int) -> str:
    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"{name} ({props['totalGlobalMem'] / 2**30:.0f} GiB), cupy {cupy.__version__}"


def graphs_enabled() -> bool:
    """CUDA graphs on unless GGRUN_CUDA_GRAPHS=0 (to compare)."""
    return os.environ.get("GGRUN_CUDA_GRAPHS", "1") not in ("0", "false", "no")


class CUDABackend(Backend):
    buffer_type = BufferType(alignment=256, max_size=1 << 40)
    stores_blocks = True

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.name = f"CUDA{index}"
        self.device = f"GPU {index}"
        self._start()

    @on_device
    def _start(self) -> None:
        index = self.index
        self.device = describe_device(index)
        self._dev = cupy.cuda.Device(index)
        with self._dev:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._staging = cupy.cuda.alloc_pinned_memory(STAGING_BYTES)
        self._host = np.frombuffer(self._staging, dtype=np.uint8, count=STAGING_BYTES)
        self._staged = 0
        self._regions: deque[tuple[int, int, object]] = deque()  # staging regions in use: (start, end, event)
        self.waits = 0  # the host's waits for all of the stream's work (_wait) so far
        self._tickets = None
        self._q8_slots = None
        self.handoffs = handoff.NONE
        self._pending: list[uploads.Upload] = []  # a split's host inputs, copied by its run
        self._peer: dict[int, bool] = {}  # another GPU's index -> whether copies from it go peer to peer
        self.use_graphs = graphs_enabled()

    @property
    def memory_pool(self) -> str:
        return self.name

    @on_device
    def free_memory(self) -> int | None:
        """Free device memory plus what cupy's pool holds unused (it hands that out first)."""
        with self._dev:
            free, _ = cupy.cuda.runtime.memGetInfo()
            return int(free) + int(cupy.get_default_memory_pool().free_bytes())

    @on_device
    def alloc_buffer(self, size: int, usage: str) -> Buffer:
        with self._dev:
            return Buffer(self, cupy.empty(size, dtype=cupy.uint8), usage)

    @on_device
    def alloc_zeroed(self, size: int, usage: str) -> Buffer:
        """Zeroed on this GPU and on its stream (the KV cache): a plain fill would run on the current
        device, which need not be this one, and on the null stream, which this stream does not wait for."""
        with self._dev, self.stream:
            return Buffer(self, cupy.zeros(size, dtype=cupy.uint8), usage)

    @on_device
    def fill_bytes(self, buf: Buffer, offset: int, nbytes: int, value: int) -> None:
        with self._dev, self.stream:
            buf.storage[offset:offset + nbytes].fill(value)

    @on_device
    def read_bytes(self, buf: Buffer, offset: int, nbytes: int) -> np.ndarray:
        self._flush()
        out = np.empty(nbytes, np.uint8)
        with self._dev:
            self._wait()
            cupy.cuda.runtime.memcpy(out.ctypes.data, buf.storage.data.ptr + offset, nbytes, D2H)
        return out

    # ---- ops -----------------------------------------------------------------------------

    def supports_op(self, node: Tensor) -> bool:
        """Block-quantized data only as the weights of products and embedding lookups (2-d, of a type
        the kernels decode; 3-d: the experts' matrices of mul_mat_id); a quantized KV cache's reads and
        writes stay on the CPU; of the RoPEs only rope takes frequency factors (rope_ff)."""
        if node.params.get("factors") and node.op != "rope":
            return False
        quantized = [s for s in node.srcs if s.dtype.is_quantized]
        if node.dtype.is_quantized:
            return False
        if quantized:
            dims = 3 if node.op == "mul_mat_id" else 2
            return node.op in BLOCK_OPS and all(
                s.dtype.name in TYPE_IDS and len(s.shape) == dims and s.is_contiguous for s in quantized)
        return TABLE.handles(node.op) or node.op in KERNELS

    def tickets(self, n: int) -> "cupy.ndarray":
        """n zeroed ints that kernels whose blocks count themselves in (to elect a last block) share:
        launches on the one stream never overlap, and each leaves its counters at 0 again."""
        if self._tickets is None:
            with self._dev:
                self._tickets = cupy.zeros(TICKETS, dtype=cupy.int32)
        if n > TICKETS:
            raise ValueError(f"{n} counters asked, {TICKETS} exist")
        return self._tickets

    def q8_slot(self, slot: int) -> int:
        """Device address of a hand-off slot: 8-bit activations a kernel writes for the product after
        it (handoff.py). The slots are made once, SLOTS * SLOT_BYTES (1 MiB) in all."""
        if self._q8_slots is None:
            with self._dev:
                self._q8_slots = cupy.empty(handoff.SLOTS * handoff.SLOT_BYTES, dtype=cupy.uint8)
        return self._q8_slots.data.ptr + slot * handoff.SLOT_BYTES

    def scratch_bytes(self, node: Tensor) -> int:
        return TABLE.scratch_bytes(node)

    def array(self, t: Tensor) -> "cupy.ndarray":
        self.check_owned(t)
        root = t.root
        cached = t._array
        if cached is not None and cached[0] is root.buffer and cached[1] == root.offset:
            return cached[2]
        storage = root.buffer.storage
        if t.dtype.is_quantized:
            arr = storage[t.data_offset:t.data_offset + t.nbytes]
        else:
            arr = cupy.ndarray(t.shape, dtype=storage_dtype(t), memptr=storage.data + t.data_offset,
                               strides=t.strides)
        t._array = (root.buffer, root.offset, arr)
        return arr

    @on_device
    def prepare(self, nodes: list[Tensor]) -> Prepared:
        """One bound kernel launch per node (the shared array kernels where none binds); launch.plan
        decides which start while the kernel before them still runs."""
        steps: list[Step] = []
        self.handoffs = handoff.Handoffs(nodes, _matmul.reads_q8)
        with self._dev:
            while len(steps) < len(nodes):
                i = len(steps)
                fused = self._fuse(nodes, i)
                if fused is not None:  # the first node's step runs them all; the others' steps are empty
                    steps.append(fused[0])
                    steps.extend(Step(nothing, True, n.op) for n in nodes[i + 1:i + fused[1]])
                else:
                    steps.append(self._bind(nodes[i]))
            launch.plan(launches_of(steps))
        return Prepared(steps)

    def _bind(self, n: Tensor) -> Step:
        if n.n_elements == 0:  # no rows this micro-batch (outputs of a batch without logits)
            return Step(nothing, True, n.op)
        out, srcs = self.array(n), [self.array(s) for s in n.srcs]
        scratch = self.array(n.scratch) if n.scratch is not None else None
        step = TABLE.bind(n, out, srcs, scratch, self)
        return step if step is not None else Step(partial(KERNELS[n.op], cupy, n, out, srcs), False, n.op)

    def _fuse(self, nodes: list[Tensor], i: int) -> tuple[Step, int] | None:
        """A fused kernel (binding.FUSIONS) for the run of nodes starting at i, and the run's length."""
        for ops, fuse in FUSIONS:
            run = nodes[i:i + len(ops)]
            if tuple(n.op for n in run) != ops or any(n.n_elements == 0 for n in run):
                continue
            step = fuse(run, [self.array(n) for n in run], [[self.array(s) for s in n.srcs] for n in run], self)
            if step is not None:
                return step, len(ops)
        return None

    def run_prepared(self, prepared: Prepared) -> None:
        """Run a prepared split on the stream. A replay (a decode step) does so without entering the device's and
        the stream's contexts while the device is current: both, entered and left, took 1.5 us of the H100
        host's time per step."""
        ups, self._pending = self._pending, []
        try:
            if prepared.replays(ups) and cupy.cuda.runtime.getDevice() == self.index:
                prepared.run(self.stream, self.use_graphs, ups, self.waits)
                return
            with self._dev, self.stream:
                prepared.run(self.stream, self.use_graphs, ups, self.waits)
        except DEVICE_ERRORS as err:  # as on_device says it, without a wrapper's call on every step
            raise DeviceFailure(f"{self.name} ({self.device})", f"{type(err).__name__}: {err}") from err

    def _wait(self) -> None:
        """Wait for all work on the stream, and count it: what was launched before has run (`waits`), the
        staging regions read by it too."""
        self.stream.synchronize()
        self.waits += 1
        self._regions.clear()

    @on_device
    def compute(self, nodes: list[Tensor]) -> None:
        self.run_prepared(self.prepare(nodes))

    # ---- copies ----------------------------------------------------------------------------

    def _stage(self, nbytes: int) -> tuple[int, np.ndarray]:
        """nbytes of pinned staging memory (device-visible address, host array), the next region of the
        ring; waits only for the events of the earlier copies still reading those bytes. The caller marks
        the region's copy (`_staged_read`) unless it waits for the stream itself."""
        if self._staged + nbytes > STAGING_BYTES:
            self._staged = 0
        start = self._staged
        end = start + -(-nbytes // 256) * 256
        while self._regions and self._regions[0][0] < end and (start < self._regions[0][1]):
            self._regions.popleft()[2].synchronize()
        self._staged = end
        return self._staging.ptr + start, self._host[start:start + nbytes]

    def _staged_read(self, addr: int, nbytes: int) -> None:
        """The region at addr is read by the copy just issued on the stream: it is free after this event."""
        start = addr - self._staging.ptr
        with self._dev:
            event = cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
        self._regions.append((start, start + nbytes, event))

    @on_device
    def set_tensor(self, t: Tensor, data: np.ndarray) -> None:
        self._flush()
        dst = self.array(t)
        src = np.ascontiguousarray(data)
        with self._dev:
            if not dst.flags.c_contiguous:
                with self.stream:
                    dst[...] = cupy.asarray(src).reshape(dst.shape)
                return
            if src.nbytes != dst.nbytes:
                raise ValueError(f"set_tensor {t.describe()}: {src.nbytes} bytes given, {dst.nbytes} expected")
            self._upload(src, dst.data.ptr)

    def _upload(self, src: np.ndarray, dst_ptr: int) -> None:
        """A contiguous host array to device memory: through staging, asynchronously, unless it is
        larger than the staging memory (weights at load: straight from pageable memory)."""
        with self._dev:
            if src.nbytes > STAGING_BYTES:
                self._wait()
                cupy.cuda.runtime.memcpy(dst_ptr, src.ctypes.data, src.nbytes, H2D)
                return
            addr, host = self._stage(src.nbytes)
            host[...] = src.reshape(-1).view(np.uint8)
            cupy.cuda.runtime.memcpyAsync(dst_ptr, addr, src.nbytes, H2D, self.stream.ptr)
            self._staged_read(addr, src.nbytes)

    @on_device
    def get_tensor(self, t: Tensor) -> np.ndarray:
        self._flush()
        src = self.array(t)
        with self._dev:
            if not src.flags.c_contiguous:
                with self.stream:
                    src = cupy.ascontiguousarray(src)
            if src.nbytes <= PINNED_RESULT_BYTES:  # a decode step's logits: straight into pinned memory
                mem = cupy.cuda.alloc_pinned_memory(max(1, src.nbytes))
                out = np.frombuffer(mem, dtype=src.dtype, count=src.size).reshape(src.shape)
                cupy.cuda.runtime.memcpyAsync(mem.ptr, src.data.ptr, src.nbytes, D2H, self.stream.ptr)
                self._wait()
                return out
            out = np.empty(src.shape, dtype=src.dtype)
            if out.nbytes > STAGING_BYTES:
                self._wait()
                cupy.cuda.runtime.memcpy(out.ctypes.data, src.data.ptr, out.nbytes, D2H)
                return out
            addr, host = self._stage(out.nbytes)
            cupy.cuda.runtime.memcpyAsync(addr, src.data.ptr, out.nbytes, D2H, self.stream.ptr)
            self._wait()
            out.reshape(-1).view(np.uint8)[...] = host
            return out

    @on_device
    def get_checked(self, t: Tensor) -> tuple[np.ndarray, bool]:
        """A decode step's logits (f32, contiguous, up to PINNED_RESULT_BYTES): one kernel writes them into
        pinned memory through the device's mapping and flags non-finite values on the way, so the host
        never reads them to check (summing 513 KB that a copy had just landed took the H100's host some
        40 us; copy and check were 56 us, the kernel is 30). Only the wait and the flags' test follow the
        launch: the arrays over the pinned memory are made while the GPU works (after the wait they took
        11 us, and leaving the device's context 3, of the H100 host's time). Anything else as the base
        class does."""
        src = self.array(t)
        if t.dtype is not DType.F32 or not src.flags.c_contiguous or not 0 < src.nbytes <= PINNED_RESULT_BYTES:
            return super().get_checked(t)
        self._flush()
        with self._dev, self.stream:  # everything but the wait and the flags' test while the GPU works
            mem = cupy.cuda.alloc_pinned_memory(src.nbytes + 4 * FETCH_BLOCKS)
            args = (np.uint64(src.data.ptr), np.int64(src.size), np.uint64(mem.ptr), np.uint64(mem.ptr + src.nbytes))
            kernel("elementwise.cu", "fetch_checked")((FETCH_BLOCKS,), (256,), args)
            host = np.frombuffer(mem, dtype=np.float32, count=src.size + FETCH_BLOCKS)
            out, flags = host[:src.size].reshape(src.shape), memoryview(host[src.size:])
        self._wait()
        return out, flags.tobytes() == NO_FLAGS  # compared as bytes: numpy's any() took 2.5 us of the H100's host

    def plan_copies(self, pairs: list[tuple[Tensor, Tensor]]) -> Callable[[], None]:
        """A split's inputs, resolved once: the host arrays bound for contiguous tensors are handed to the
        split's run, whose CUDA graph copies them from a pinned region (uploads.py; one list, the same every
        call, so the region knows it); other pairs, and uploads too large for a region, are copied by each call."""
        ups, others = [], []
        for src, dst in pairs:
            owner = src.root.buffer.backend
            a = owner.array(src) if owner.memory_pool == "CPU" else None
            d = self.array(dst)
            if a is not None and a.flags.c_contiguous and d.flags.c_contiguous and a.nbytes == d.nbytes:
                ups.append((a, d.data.ptr))
            else:
                others.append((src, dst))
        staged = sum(a.nbytes for a, _ in ups) > uploads.MOST_BYTES
        direct, ups = (ups, []) if staged else ([], ups)

        @on_device
        def copy(self: CUDABackend) -> None:
            self._flush()
            for src, dst in others:
                self._copy_in(src, dst)
            for a, dst_ptr in direct:
                self._upload(a, dst_ptr)
            self._pending = ups
        return partial(copy, self)

    def _flush(self) -> None:
        """Copy inputs still waiting for a split's run (any other call on the backend comes after them)."""
        ups, self._pending = self._pending, []
        for a, dst_ptr in ups:
            self._upload(a, dst_ptr)

    @on_device
    def copy_tensor(self, src: Tensor, dst: Tensor) -> None:
        """A host tensor's bytes go up through staging; another GPU's, device to device."""
        self._flush()
        self._copy_in(src, dst)

    def _copy_in(self, src: Tensor, dst: Tensor) -> None:
        owner = src.root.buffer.backend
        if isinstance(owner, CUDABackend) and owner is not self:
            self._copy_from_gpu(owner, src, dst)
            return
        if owner is self:
            a, b = self.array(src), self.array(dst)
            with self._dev, self.stream:
                b[...] = a.reshape(b.shape) if a.flags.c_contiguous else cupy.ascontiguousarray(a).reshape(b.shape)
            return
        self.set_tensor(dst, owner.array(src) if owner.memory_pool == "CPU" else owner.get_tensor(src))

    # ---- events and copies between GPUs ------------------------------------------------------

    @on_device
    def record_event(self) -> "cupy.cuda.Event":
        self._flush()
        with self._dev:
            event = cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
        return event

    @on_device
    def wait_event(self, event) -> None:
        if event is not None:
            with self._dev:
                self.stream.wait_event(event)

    @on_device
    def peer_access(self, other: "CUDABackend") -> bool:
        """Whether the two GPUs can read each other's memory (cupy's deviceCanAccessPeer both ways);
        enables it the first time, both ways. Without it, copies between them go through host memory."""
        known = self._peer.get(other.index)
        if known is None:
            rt = cupy.cuda.runtime
            known = bool(rt.deviceCanAccessPeer(self.index, other.index)) and bool(
                rt.deviceCanAccessPeer(other.index, self.index))
            if known:
                _enable_peer(self, other)
                _enable_peer(other, self)
            self._peer[other.index] = known
        return known

    def _copy_from_gpu(self, owner: "CUDABackend", src: Tensor, dst: Tensor) -> None:
        """src (on GPU `owner`) into dst on this GPU, on this GPU's stream: after the source's kernels that wrote
        src (an event), and the source's later kernels after the copy (an event), so that neither stream waits
        for the whole of the other. On this stream the copy follows whatever this GPU still computes in dst's
        memory under an earlier plan, which a copy on the source's stream would not (graphs are planned anew
        as a prompt's micro-batches see more cells). With pipelined micro-batches the source's next one then
        starts once this GPU has finished the one before, as the two stages' turns alternate."""
        a, b = owner.array(src), self.array(dst)
        if not b.flags.c_contiguous:  # not a scheduler copy (those are contiguous): through the host
            self.set_tensor(dst, owner.get_tensor(src))
            return
        if not a.flags.c_contiguous:  # a view: made contiguous on its own GPU first, in stream order
            with owner._dev, owner.stream:
                a = cupy.ascontiguousarray(a)
        if a.nbytes != b.nbytes:
            raise ValueError(f"copy {src.describe()} -> {dst.describe()}: {a.nbytes} bytes, {b.nbytes} expected")
        if self.peer_access(owner):
            self.wait_event(owner.record_event())  # after the kernels that wrote src
            with self._dev:
                cupy.cuda.runtime.memcpyPeerAsync(b.data.ptr, self.index, a.data.ptr, owner.index, b.nbytes,
                                                  self.stream.ptr)
            owner.wait_event(self.record_event())  # src's memory is written again only after the copy read it
            return
        self._copy_staged(owner, a.data.ptr, b.data.ptr, b.nbytes)

    def _copy_staged(self, owner: "CUDABackend", src_ptr: int, dst_ptr: int, nbytes: int) -> None:
        """Through this backend's pinned staging memory, a piece at a time: device to host on the source's
        stream (after what wrote it there), host to device on this stream once that piece has landed.
        A staging region is handed out again only after this stream has read it (_stage's events)."""
        done = 0
        while done < nbytes:
            n = min(STAGING_BYTES, nbytes - done)
            addr, _ = self._stage(n)
            with owner._dev:
                cupy.cuda.runtime.memcpyAsync(addr, src_ptr + done, n, D2H, owner.stream.ptr)
            self.wait_event(owner.record_event())
            with self._dev:
                cupy.cuda.runtime.memcpyAsync(dst_ptr + done, addr, n, H2D, self.stream.ptr)
            self._staged_read(addr, n)
            done += n

    def address(self, arr) -> int:
        return int(arr.data.ptr)


def _enable_peer(backend: CUDABackend, other: CUDABackend) -> None:
    """Let `backend`'s GPU read and write `other`'s memory directly; enabling it twice is not an error."""
    with backend._dev:
        try:
            cupy.cuda.runtime.deviceEnablePeerAccess(other.index)
        except cupy.cuda.runtime.CUDARuntimeError as err:
            if err.status != PEER_ACCESS_ALREADY_ENABLED:
                raise
