"""GPU time of each node of a planned graph's CUDA splits, by node kind (the profiling scripts' table; no
profiler needed): each bound step is captured alone in a CUDA graph and launched once between events, so the
host's launch time does not count; a step that cannot be captured is timed eagerly. Once, not many times: a
step run again and again on its own outputs (an in-place sum, a mixture's routing) can drift to values that
the next step reads as indices (an H200 met an illegal address so, replaying qwen3moe's steps 20 times)."""
from __future__ import annotations

import re

import cupy


def node_times(sg, gpu) -> dict[str, list[float]]:
    """Milliseconds of each node of sg's splits that run on `gpu`, keyed by the node's name without its layer
    number. The splits' input copies run first (their memory may serve later nodes meanwhile)."""
    by_kind: dict[str, list[float]] = {}
    with gpu._dev, gpu.stream:
        for split in sg.splits:
            if split.backend is not gpu or split.calls is None:
                continue
            for c in split.copies:
                gpu.copy_tensor(c.srcs[0], c)
            for node, step in zip(split.nodes, split.calls.steps):
                by_kind.setdefault(re.sub(r"-\d+", "", node.name), []).append(_step_ms(step, gpu.stream))
    return by_kind


def _step_ms(step, stream) -> float:
    """Milliseconds of one run of `step` on `stream`: one launch of its captured graph, or one eager run where it
    cannot be captured."""
    graph = None
    if step.capturable:
        stream.begin_capture()
        try:
            step()
        finally:
            graph = stream.end_capture()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    graph.launch(stream) if graph is not None else step()
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end)


def print_node_times(by_kind: dict[str, list[float]], title: str) -> None:
    """The table of node_times: total, then each kind's count, milliseconds and share, largest first."""
    total = sum(sum(v) for v in by_kind.values())
    print(f"{title}: {total:.3f} ms (each kernel launched alone)", flush=True)
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {kind:28s} {len(ms):4d} x  {sum(ms):7.3f} ms  ({100 * sum(ms) / total:4.1f}%)", flush=True)
