"""A split's host inputs as part of its CUDA graph.

A decode step's inputs (the embedded token, positions, cache rows, mask, output rows) are a few
hundred bytes each; copying them one call at a time cost more host time than any kernel of the
step. Instead each prepared split owns a pinned host region with a fixed place for each input: a
step writes the inputs' bytes there, and one kernel (gather_inputs) reads the small ones through the
device's mapping of pinned memory and writes each to its place; it is captured into the split's CUDA
graph with the other kernels, so one graph launch does both. As a graph's copy nodes, the four inputs
of a decode step took some 18 us of the step (their gaps included), the kernel about 4. Larger inputs
(a prompt's embeddings and mask) are copied by the copy engines, which a block reading host memory
over the bus cannot match: through the kernel, a 512-token prompt of llama-135m took 1.5-1.8x as long.
The region is written again only after the last launch that reads it has run (an event).
"""
from __future__ import annotations

from typing import Sequence

import cupy
import numpy as np

from ggrun.core.backends.cuda.module import kernel

ALIGN = 256
MOST_BYTES = 4 << 20  # inputs beyond this go up through the backend's staging memory instead
GATHER_BYTES = 64 << 10  # inputs up to this size go up by gather_inputs, larger ones by a copy each

Upload = tuple[np.ndarray, int]  # a contiguous host array, and the device address it goes to


def layout(ups: Sequence[Upload]) -> tuple[tuple[int, int], ...]:
    """(device address, bytes) of each upload: what a region and its captured copies are made for."""
    return tuple((dst, a.nbytes) for a, dst in ups)


class UploadRegion:
    """Pinned memory for one layout of uploads, and the copies out of it."""

    def __init__(self, ups: Sequence[Upload]) -> None:
        self.layout = layout(ups)
        self.offsets = []
        at = 0
        for _, n in self.layout:
            self.offsets.append(at)
            at += -(-n // ALIGN) * ALIGN
        self._mem = cupy.cuda.alloc_pinned_memory(max(at, ALIGN))
        self._host = np.frombuffer(self._mem, dtype=np.uint8, count=max(at, ALIGN))
        self._read = None  # event after the last launch reading the region
        self._read_at: int | None = None  # the count of waits for the stream when that launch was issued
        self.ups: Sequence[Upload] | None = None  # the uploads last filled in, and their places:
        self._copies: list[tuple[np.ndarray, np.ndarray]] = []  # (place in the region, the array's bytes)
        places = list(zip(self.offsets, self.layout))
        self._small = [(at, dst, n) for at, (dst, n) in places if n <= GATHER_BYTES]
        self._large = [(at, dst, n) for at, (dst, n) in places if n > GATHER_BYTES]
        self._table = cupy.asarray(np.array(self._small, dtype=np.int64).reshape(-1)) if self._small else None

    def serves(self, ups: Sequence[Upload]) -> bool:
        """Whether ups fit this region's places: the list filled in last (a split's copies hand the same
        one to every run), or one of the same layout."""
        return ups is self.ups or self.layout == layout(ups)

    def fill(self, ups: Sequence[Upload], waits: int | None = None) -> None:
        """The uploads' bytes into their places, once the copies of the last run have read them: known when
        the host has waited for the whole stream since (`waits` counts those waits; a decode step's logits
        are waited for), else by the event (its wait took some 2.4 us of the H100's host when done). The
        byte views of a list's arrays and places are made when a list is first seen."""
        if self._read is not None and (waits is None or self._read_at is None or waits <= self._read_at):
            self._read.synchronize()
        if ups is not self.ups:
            self.ups = ups
            self._copies = [(self._host[at:at + a.nbytes], a.reshape(-1).view(np.uint8))
                            for (a, _), at in zip(ups, self.offsets)]
        for place, data in self._copies:
            np.copyto(place, data)

    def issue(self, stream) -> None:
        """The copies of the large inputs and the launch copying the small ones to the device, on stream
        (the current one, where cupy launches; recorded into a graph when it captures). The pinned
        region's host address serves on the device too (unified addressing)."""
        for at, dst, n in self._large:
            cupy.cuda.runtime.memcpyAsync(dst, self._mem.ptr + at, n, cupy.cuda.runtime.memcpyHostToDevice,
                                          stream.ptr)
        if self._table is not None:
            args = (np.uint64(self._mem.ptr), np.uint64(self._table.data.ptr))
            kernel("elementwise.cu", "gather_inputs")((len(self._small),), (256,), args)

    def issued(self, stream, waits: int | None = None) -> None:
        """Mark the point of stream after which the region may be written again (with the count of waits for
        the stream so far, when known)."""
        if self._read is None:
            self._read = cupy.cuda.Event(disable_timing=True)
        self._read.record(stream)
        self._read_at = waits
