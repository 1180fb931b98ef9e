"""GGRUN_GRAPH_DEBUG's lines: one per micro-batch on stderr, saying whether its graph was reused or rebuilt
and why, with its shapes (`1`), padding of a bucket, and at `2` its nodes, splits, compute buffers and build,
plan and compute times. The session decides and times; this module only words and prints."""
from __future__ import annotations

import os
import sys

from ggrun.core.llm.batch import UBatch
from ggrun.core.llm.graph_result import GraphResult
from ggrun.core.llm.inputs import GraphParams
from ggrun.core.sched import Scheduler


def graph_debug_level() -> int:
    """GGRUN_GRAPH_DEBUG as a level: 0 (unset or not a number), 1 or 2."""
    try:
        return int(os.environ.get("GGRUN_GRAPH_DEBUG", "0") or 0)
    except ValueError:
        return 0


def decision_line(said: str, p: GraphParams, res: GraphResult, sched: Scheduler, times: tuple[float, float],
                  level: int) -> str:
    """The line of a reuse decision (graph_reuse.Decision.said) for a graph of params p; at level 2 with
    res's size, the scheduler's buffers and the (build, plan) seconds."""
    swa = f", n_kv_swa {p.n_kv_swa}" if p.n_kv_swa else ""
    line = f"graph: {said} (n_tokens {p.n_tokens}, n_outputs {p.n_outputs}, n_kv {p.n_kv}{swa})"
    if level >= 2:
        sizes = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sched.buffer_sizes().items())
        line += (f" nodes {len(res.sg.graph.nodes)} splits {len(res.sg.splits)} buffers [{sizes}]"
                 f" build {1e3 * times[0]:.2f} ms plan {1e3 * times[1]:.2f} ms")
    return line


def print_ubatch(line: str, ub: UBatch, compute_s: float, level: int) -> None:
    """Print a micro-batch's decision line once its compute time is known: with its bucket's padding, and at
    level 2 the time."""
    pad = f" bucket {ub.n_tokens} ({ub.n_real} + {ub.n_pad} padding)" if ub.n_pad else ""
    print(line + pad + (f" compute {1e3 * compute_s:.2f} ms" if level >= 2 else ""), file=sys.stderr)
