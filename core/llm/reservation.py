"""A session's worst case, measured and reserved at creation: every backend's compute buffer sized for the
largest graph the session can run, checked against the memory free beside the KV cache, so that buffers
exist before the first token and never grow while generating. The graphs come from the session's builder;
nothing here builds a model's graph or runs one."""
from __future__ import annotations

import time
from typing import Callable, Iterable

from ggrun.core.graph import Graph
from ggrun.core.llm.budget import Budget
from ggrun.core.llm.graph_result import GraphResult
from ggrun.core.llm.inputs import GraphParams
from ggrun.core.sched import Scheduler

Builder = Callable[[GraphParams], GraphResult]  # Session.build: the decode graph for params, scheduled


def worst_case_params(n_ubatch: int, n_ctx: int, n_ctx_swa: int, all_logits: bool = True) -> GraphParams:
    """The largest decode graph: n_ubatch tokens (at most the context) over every cell of each cache
    (n_ctx_swa: the sliding-window cache's cells, 0 without one); logits for all of them, or for one."""
    n = min(n_ubatch, n_ctx)
    return GraphParams(n_tokens=n, n_outputs=n if all_logits else 1, n_kv=n_ctx, n_kv_swa=n_ctx_swa)


def plan_worst_case(sched: Scheduler, build: Builder, worst: GraphParams) -> tuple[GraphResult, dict, float]:
    """Build and measure the worst-case graph without allocating: (graph, plans, plan seconds)."""
    res = build(worst)
    t0 = time.perf_counter()
    plans = sched.measure(res.sg)
    return res, plans, time.perf_counter() - t0


def reserve(sched: Scheduler, build: Builder, worst: GraphParams, k_shift_graphs: Iterable[Graph],
            budget: Budget | None, kv_need: dict[str, int]) -> dict:
    """Reserve every backend's compute buffer for the largest graph the session can run; the plans reserved.

    That is n_ubatch tokens over the full context (`worst`), but the worst number of logit rows is not
    obvious: fewer rows than tokens adds the output-row input and get_rows results that live
    beside their sources, so logits for all tokens but one can need more than logits for all
    (or for one). The K-shift graph (after seq_add) holds a rotated copy of one layer's keys
    over all cells, the largest of all when n_ubatch is small. Each is measured, and the
    largest reserved first, so that one allocation per backend is the usual case; a graph that
    fits in what is reserved already is not planned a second time (it would allocate nothing).
    `k_shift_graphs` is read after the decode graphs are built. With a budget, the compute buffers must fit
    beside the cache (kv_need) before they are allocated."""
    n = worst.n_tokens
    graphs = [build(GraphParams(n, k, worst.n_kv, worst.n_kv_swa)).sg
              for k in sorted({n, max(n - 1, 1), 1}, reverse=True)]
    graphs += [sched.schedule(g) for g in k_shift_graphs]
    measured = [sched.measure(sg) for sg in graphs]
    need = [sum(p.size for p in m.values()) for m in measured]
    if budget is not None:
        compute: dict[str, int] = {}
        for m in measured:
            for name, plan in m.items():
                compute[name] = max(compute.get(name, 0), plan.size)
        budget.check({"KV cache": kv_need, "compute buffers": compute})
    plans: dict = {}
    for i in sorted(range(len(graphs)), key=lambda i: -need[i]):
        if plans and all(name in plans and m.size <= plans[name].size for name, m in measured[i].items()):
            continue
        for name, plan in sched.reserve(graphs[i]).items():
            if name not in plans or plan.size > plans[name].size:
                plans[name] = plan
    return plans
