"""CUDA-graph replay keyed on graph reuse: a split's bound steps run eagerly the first time
(kernels get compiled and loaded), are captured into a CUDA graph the second time, and from then
on the graph is launched: one launch for the whole split. The engine makes a new Prepared when it
replans (a new graph shape, a changed cache layout), so a reused ggrun graph is what replays.
Per-token inputs reach fixed device addresses by copies made before the launch.

GGRUN_GRAPH_DEBUG=1 reports each capture, and why a split is not captured.
"""
from __future__ import annotations

import os
import sys

from ggrun.core.backends.cuda.binding import Step


def _debug() -> bool:
    return os.environ.get("GGRUN_GRAPH_DEBUG", "0") not in ("", "0")


class Prepared:
    """The steps of one split, and its captured CUDA graph once it has one."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.runs = 0
        self.graph = None
        blockers = sorted({s.name for s in steps if not s.capturable})
        self.blocker = f"not captured: {', '.join(blockers)} run outside CUDA graphs" if blockers else None

    def __len__(self) -> int:
        return len(self.steps)

    def run(self, stream, use_graphs: bool) -> None:
        self.runs += 1
        if self.graph is not None:
            self.graph.launch(stream)
            return
        if not use_graphs or self.blocker is not None or self.runs == 1:
            if use_graphs and self.runs == 2 and self.blocker and _debug():
                print(f"cuda graph: {self.blocker}", file=sys.stderr)
            for step in self.steps:
                step()
            return
        stream.begin_capture()
        try:
            for step in self.steps:
                step()
        finally:
            graph = stream.end_capture()
        self.graph = graph
        if _debug():
            print(f"cuda graph: captured {len(self.steps)} kernels", file=sys.stderr)
        self.graph.launch(stream)
