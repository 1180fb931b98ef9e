"""CUDA-graph replay keyed on graph reuse: a split's bound steps run eagerly the first time
(kernels get compiled and loaded), are captured into a CUDA graph the second time, and from then
on the graph is launched: one launch for the whole split. The engine makes a new Prepared when it
replans (a new graph shape, a changed cache layout), so a reused ggrun graph is what replays.
Per-token inputs reach fixed device addresses from a pinned region, by a kernel captured with the
others (uploads.py).

GGRUN_GRAPH_DEBUG=1 reports each capture, and why a split is not captured.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from ggrun.core.backends.cuda.binding import Step
from ggrun.core.backends.cuda.uploads import Upload, UploadRegion


def _debug() -> bool:
    return os.environ.get("GGRUN_GRAPH_DEBUG", "0") not in ("", "0")


class Prepared:
    """The steps of one split, the pinned region its host inputs pass through (uploads.py), and its
    captured CUDA graph once it has one: the inputs' launch out of the region, then the steps."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.runs = 0
        self.graph = None
        self.region: UploadRegion | None = None
        blockers = sorted({s.name for s in steps if not s.capturable})
        self.blocker = f"not captured: {', '.join(blockers)} run outside CUDA graphs" if blockers else None

    def __len__(self) -> int:
        return len(self.steps)

    def replays(self, ups: Sequence[Upload]) -> bool:
        """Whether run(ups) only fills the region and launches the captured graph: host calls on the stream and
        the region's pinned memory, which need neither the current stream nor a kernel's module."""
        if self.graph is None:
            return False
        return self.region.serves(ups) if self.region is not None else not ups

    def run(self, stream, use_graphs: bool, ups: Sequence[Upload] = (), waits: int | None = None) -> None:
        """Copy ups (host arrays to device addresses) and run the steps, on stream; `waits` counts the host's
        waits for all of the stream's work so far (None: not counted), which tells the region when its last
        readers are done."""
        self.runs += 1
        if self.region is not None and not self.region.serves(ups):
            self.region = self.graph = None  # a captured graph reads the old region's places
        if ups and self.region is None:
            self.region = UploadRegion(ups)
        if self.region is not None:
            self.region.fill(ups, waits)
        if self.graph is not None:
            self.graph.launch(stream)
        elif not use_graphs or self.blocker is not None or self.runs == 1:
            if use_graphs and self.runs == 2 and self.blocker and _debug():
                print(f"cuda graph: {self.blocker}", file=sys.stderr)
            self._issue(stream)
        else:
            self._capture(stream)
            self.graph.launch(stream)
        if self.region is not None:
            self.region.issued(stream, waits)

    def _issue(self, stream) -> None:
        if self.region is not None:
            self.region.issue(stream)
        for step in self.steps:
            step()

    def _capture(self, stream) -> None:
        stream.begin_capture()
        try:
            self._issue(stream)
        finally:
            graph = stream.end_capture()
        self.graph = graph
        if _debug():
            copies = len(self.region.layout) if self.region is not None else 0
            print(f"cuda graph: captured {len(self.steps)} kernels and {copies} input copies", file=sys.stderr)
