"""Kernel launches with programmatic dependent launch (PDL, compute capability 9.0 and later).

A kernel launched with the PDL attribute may be started by the GPU while the kernel before it on the
stream is still running: its blocks take places that kernel leaves free and wait (common.cuh's
pdl_begin, which every ggrun kernel calls before it reads what another kernel wrote) until that kernel
has finished and its writes are visible. Before that wait a kernel may do work that depends on no
other kernel: the decode products ask L2 for their weights, attention for its cached rows, a norm loads
its weight. That hides the launch gap and the first memory round trip of each of the hundreds of short
kernels of a decode step. Captured into a CUDA graph, the attribute becomes a programmatic edge, so
replays keep it. `plan` decides, per split, which launches start early.

cupy's RawKernel cannot pass launch attributes, so these launches call the driver's cuLaunchKernelEx
through ctypes, with the arguments packed once per bound launch. GGRUN_CUDA_PDL=0 turns this off (to
compare); devices before 9.0 never use it.
"""
from __future__ import annotations

import ctypes
import math
import os
from functools import lru_cache

import cupy
import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
TICKETS = 1024  # counters shared by kernels that elect a last block (backend.tickets: one per KV head in attention)


class LaunchError(RuntimeError):
    """cuLaunchKernelEx refused a launch (its CUresult)."""


class _Attr(ctypes.Structure):
    """CUlaunchAttribute: an id, then a 64-byte value union (here the 'serialization allowed' int)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


@lru_cache(maxsize=None)
def _driver():
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@lru_cache(maxsize=None)
def _device(device: int) -> tuple[bool, int]:
    """(compute capability 9.0 or later, multiprocessors)."""
    dev = cupy.cuda.Device(device)
    return int(dev.compute_capability) >= 90, dev.attributes["MultiProcessorCount"]


def multiprocessors() -> int:
    """The current device's multiprocessors."""
    return _device(cupy.cuda.Device().id)[1]


def available() -> bool:
    """PDL launches on the current device: compute capability 9.0 or later, unless GGRUN_CUDA_PDL=0."""
    if os.environ.get("GGRUN_CUDA_PDL", "1") in ("0", "false", "no"):
        return False
    return _device(cupy.cuda.Device().id)[0]


def plan(launches: list) -> None:
    """Which of a split's launches (binding.Launch, in order; None for work that is not one) start early.

    Every kernel may, except that a kernel with a prologue (a product prefetching its weights) is launched
    in the plain way first in a split, after work that is not a launch, and after a kernel whose blocks
    cover every multiprocessor (its blocks would take only the places that kernel leaves as it ends,
    and their prefetches slow its last blocks: llama-1b's down projection after the gated product,
    0.69 -> 0.83 ms a decode step, H100), unless the prologue is light (decode attention's cached rows:
    started early after the q/k/v product, llama-1b's decode graph 561 -> 550 us). A prologue runs only in
    a launch that starts early (its last argument says so)."""
    if not available():
        return
    sms = _device(cupy.cuda.Device().id)[1]
    before = None
    for item in launches:
        if item is not None:
            fills = before is None or math.prod(int(x) for x in before.grid) >= sms
            item.early = not (item.prologue and fills and not item.light)
            if item.prologue:
                item.args = item.args[:-1] + (np.int32(item.early),)
        before = item


def _triple(dims: tuple) -> tuple[int, int, int]:
    return tuple(int(x) for x in dims) + (1,) * (3 - len(dims))


class PDLLaunch:
    """One kernel launch, its configuration and arguments packed once, issued with the PDL attribute
    on the current stream."""

    def __init__(self, kernel: cupy.RawKernel, grid: tuple, block: tuple, args: tuple, smem: int) -> None:
        self.function = kernel.kernel.ptr
        self._values = [_arg_bytes(a) for a in args]  # kept alive: the pointer array points into them
        self._params = (ctypes.c_void_p * max(1, len(args)))(*[ctypes.addressof(v) for v in self._values])
        self._attr = _Attr(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._config = _Config(_triple(grid), _triple(block), smem, None, ctypes.pointer(self._attr), 1)

    def __call__(self) -> None:
        self._config.stream = cupy.cuda.get_current_stream().ptr
        err = _driver()(ctypes.byref(self._config), self.function, self._params, None)
        if err:
            raise LaunchError(f"cuLaunchKernelEx failed: CUresult {err}")


def _arg_bytes(arg) -> ctypes.Array:
    """A kernel argument's bytes, as the kernel takes it: numpy scalars as they are, arrays as their
    device address."""
    if isinstance(arg, cupy.ndarray):
        arg = np.uint64(arg.data.ptr)
    if not isinstance(arg, np.generic):
        raise TypeError(f"kernel argument {arg!r}: a numpy scalar or a cupy array expected")
    raw = arg.tobytes()
    return (ctypes.c_char * len(raw)).from_buffer_copy(raw)
