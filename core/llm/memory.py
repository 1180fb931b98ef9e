"""Memory planning per backend for a model and a configuration, without running it
(`measure`), and a check that a real run keeps every node result in its planned place and takes,
on every backend, the weight, KV cache and compute bytes the plan said (`verify`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ggrun.core.dtypes import DType
from ggrun.core.errors import RuntimeFailure
from ggrun.core.llm.batch import UBatch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.core.ops import OPS
from ggrun.core.sched import Scheduler
from ggrun.core.validate import validate_plan


@dataclass
class MemoryRecord:
    """One configuration on one backend; field names are `ggrun measure -o json`'s keys."""

    ctx: int
    ubatch: int
    logits: str  # "all": every token of the micro-batch (what llama.cpp reserves); "last": one per sequence
    backend: str
    weights_file_bytes: int
    weights_resident_bytes: int
    kv_bytes: int
    output_bytes: int
    compute_planned_bytes: int
    compute_no_reuse_bytes: int
    compute_lower_bound_bytes: int
    nodes: int
    splits: int
    plan_ms: float
    flash_attn: bool = False
    kv_swa_bytes: int = 0  # the part of kv_bytes in the sliding-window layers' own cache (iSWA)

    def to_json(self) -> dict:
        return asdict(self)


def weights_file_bytes_by_backend(model: Model) -> dict[str, int]:
    """Bytes each backend's weights take in the file (stored, possibly quantized; a matrix split by rows
    counts on each device for its rows)."""
    out: dict[str, int] = {}
    for name, info in model.gguf.tensors.items():
        for b, lo, hi in model.placement.pieces(name, info.shape):
            out[b.name] = out.get(b.name, 0) + info.n_bytes * (hi - lo) // max(info.shape[0], 1)
    return out


def measure(model: Model, ctx: int, ubatch: int, n_batch: int, n_seq: int, flash_attn: bool = False,
            type_k: DType = DType.F16, type_v: DType = DType.F16) -> list[MemoryRecord]:
    """Records for both reservation modes, every backend, for one (ctx, ubatch); the KV cache holds
    K and V as type_k and type_v (whole blocks of a quantized type)."""
    session = Session(model, SessionParams(n_ctx=ctx, n_batch=n_batch, n_ubatch=ubatch, n_seq_max=n_seq,
                                           flash_attn=flash_attn, type_k=type_k, type_v=type_v))
    file_bytes = weights_file_bytes_by_backend(model)
    resident = model.resident_bytes()
    kv = session.kv_bytes_by_backend()
    kv_swa = session.kv_swa.bytes_by_backend() if session.kv_swa is not None else {}
    cpu = session.sched.cpu.name
    records = []
    for mode in ("all", "last"):
        res, plans, secs = session.plan_worst_case(all_logits=mode == "all")
        n_out = min(n_batch, ctx) if mode == "all" else n_seq
        for b in session.sched.backends:
            plan = plans.get(b.name)
            sg = res.sg
            nodes = sum(1 for n in sg.graph.nodes if sg.backend_of.get(id(n)) is b and not OPS[n.op].view)
            records.append(MemoryRecord(
                ctx=ctx, ubatch=res.params.n_tokens, logits=mode, backend=b.name,
                weights_file_bytes=file_bytes.get(b.name, 0), weights_resident_bytes=resident.get(b.name, 0),
                kv_bytes=kv.get(b.name, 0),
                output_bytes=n_out * model.hp.n_vocab * 4 if b.name == cpu else 0,
                compute_planned_bytes=plan.size if plan else 0,
                compute_no_reuse_bytes=plan.no_reuse if plan else 0,
                compute_lower_bound_bytes=plan.lower_bound if plan else 0,
                nodes=nodes, splits=sum(1 for s in sg.splits if s.backend is b),
                plan_ms=1e3 * secs, flash_attn=flash_attn, kv_swa_bytes=kv_swa.get(b.name, 0)))
    return records


@dataclass
class Taken:
    """Bytes a real session took on one backend: resident weights, KV cache, the compute plan of its
    worst-case graph (logits for every token, as `measure`'s "all" rows)."""

    weights: int
    kv: int
    compute: int


@dataclass
class VerifyReport:
    nodes_checked: int
    max_logit_diff: float
    taken: dict[str, Taken] = field(default_factory=dict)  # per backend name


def figure_mismatches(records: list[MemoryRecord], taken: dict[str, Taken]) -> list[str]:
    """Where `measure`'s records (logits "all", one configuration) differ from what a run took: one line
    per backend and figure; none when the plan from metadata is what the run allocates."""
    out = []
    for r in records:
        if r.logits != "all":
            continue
        t = taken.get(r.backend, Taken(0, 0, 0))
        for label, planned, real in (("weights", r.weights_resident_bytes, t.weights), ("KV", r.kv_bytes, t.kv),
                                     ("compute", r.compute_planned_bytes, t.compute)):
            if planned != real:
                out.append(f"{r.backend} {label}: measured {planned} bytes, the run took {real}")
    return out


SENTINEL = 0xFF  # every byte of a node's planned region before its kernel runs: f32 NaN 0xFFFFFFFF


def verify(model: Model, ctx: int, ubatch: int, seed: int = 0, flash_attn: bool = False, n_seq: int = 1,
           type_k: DType = DType.F16, type_v: DType = DType.F16) -> VerifyReport:
    """Run one worst-case micro-batch through the planned buffers and prove the plan held:
    each plan validates, each kernel wrote its result into its planned region (filled with a
    sentinel just before it ran), and the logits equal a run where no memory is reused. The report
    says what the session took on each backend (to hold against `measure`'s figures)."""
    params = SessionParams(n_ctx=ctx, n_batch=ubatch, n_ubatch=ubatch, n_seq_max=n_seq, flash_attn=flash_attn,
                           type_k=type_k, type_v=type_v)
    session = Session(model, params)
    res = session.build(session.worst_case_params(all_logits=True))
    plans = session.sched.alloc(res.sg)
    resident, kv = model.resident_bytes(), session.kv_bytes_by_backend()
    taken = {b.name: Taken(resident.get(b.name, 0), kv.get(b.name, 0), plans[b.name].size if b.name in plans else 0)
             for b in session.sched.backends}
    for name, plan in plans.items():
        validate_plan(res.sg.order, plan.offsets, plan.sizes, plan.scratch)
    ub = _random_ubatch(model, res.params.n_tokens, seed)
    _set_inputs(session, res, ub)
    checked = _run_checked(session.sched, res.sg, plans)
    logits = session.sched.get_tensor(res.logits)

    ref_session = Session(model, replace(params, reuse_memory=False))
    ref_res = ref_session.build(ref_session.worst_case_params(all_logits=True))
    ref_session.sched.alloc(ref_res.sg)
    _set_inputs(ref_session, ref_res, ub)
    ref_session.sched.compute(ref_res.sg)
    diff = float(np.max(np.abs(ref_session.sched.get_tensor(ref_res.logits) - logits)))
    if not np.isfinite(diff) or diff > 1e-4:
        raise RuntimeFailure(f"verify: logits differ from a run without memory reuse by {diff:g}")
    return VerifyReport(checked, diff, taken)


def _random_ubatch(model: Model, n: int, seed: int) -> UBatch:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, model.hp.n_vocab, n).astype(np.int32)
    pos = np.arange(n, dtype=np.int32)
    return UBatch(toks, pos, np.zeros(n, np.int32), np.arange(n, dtype=np.int32), 0)


def _set_inputs(session: Session, res, ub: UBatch) -> None:
    res.set_inputs(session.place_ubatch(ub), session.sched.cpu)


def _run_checked(sched: Scheduler, sg, plans) -> int:
    """Compute node by node; before each planned node, poison its region; after, demand it was written."""
    inplace = {id(n) for plan in plans.values() for n, _ in plan.inplace}
    checked = 0
    for split in sg.splits:
        b = split.backend
        for c in split.copies:
            b.copy_tensor(c.srcs[0], c)
        plan = plans[b.name]
        buf = sched.allocators[b.name].buffer
        for node in split.nodes:
            own = node in plan.offsets and id(node) not in inplace and node.nbytes > 0
            if own:
                _check_placement(b, node, buf.storage, plan.offsets[node])
                b.fill_bytes(buf, node.offset, node.nbytes, SENTINEL)
            b.compute([node])
            if own:
                region = b.read_bytes(buf, node.offset, node.nbytes)
                if np.all(region == SENTINEL):
                    raise RuntimeFailure(f"verify: {node.describe()} left its planned memory untouched "
                                         "(its result went somewhere else)")
                checked += 1
    return checked


def _check_placement(backend, node, storage, offset: int) -> None:
    """The array a kernel writes into starts exactly at the node's planned offset."""
    at = backend.address(backend.array(node)) - backend.address(storage)
    if at != offset:
        raise RuntimeFailure(f"verify: {node.describe()} is at byte {at}, planned at {offset}")
