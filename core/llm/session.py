"""A session: one model, its KV caches, one scheduler; decodes batches micro-batch by micro-batch, running
a kept graph whenever graph_reuse.decide lets it and building one otherwise.

The loop is here; what it leans on has a module each: the caches are made to fit the memory free
(session_caches.py), the worst-case graph is reserved at creation so compute buffers exist before the
first token and do not grow while generating (reservation.py), the reuse rule and the kept graphs
(graph_reuse.py), the next decode step readied while a device runs this one (ready_step.py), and
GGRUN_GRAPH_DEBUG's lines (graph_debug.py). Logits that hold NaN or infinity stop decoding
(core.llm.numerics), never reach a sampler. A caller may set `interrupt`, a poll asked before each
micro-batch: when it says stop, decode raises Interrupted with the cache holding exactly the
micro-batches already computed.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import numpy as np

from ggrun.core import ops
from ggrun.core.errors import BadInput, Interrupted, RuntimeFailure
from ggrun.core.graph import build_graph
from ggrun.core.llm import reservation
from ggrun.core.llm.batch import Batch, UBatch, split_batch
from ggrun.core.llm.batched_sampler import SamplingRows, sample_on_host
from ggrun.core.llm.buckets import pad_mixed, pad_state, shares_prefix, wants_bucket
from ggrun.core.llm.blocks import Build
from ggrun.core.llm.budget import Budget
from ggrun.core.llm.graph_debug import decision_line, graph_debug_level, print_ubatch
from ggrun.core.llm.graph_result import GraphResult
from ggrun.core.llm.graph_reuse import Decision, GraphCache, REUSED, reuse_enabled_by_env
from ggrun.core.llm.inputs import GraphInputs, GraphParams, UBatchState
from ggrun.core.llm.kv_cache import KVCache
from ggrun.core.llm.model import Model
from ggrun.core.llm.numerics import NonFiniteLogits, first_non_finite, non_finite_kind
from ggrun.core.llm.ready_step import ReadyStep, readies, ready_next, stamp
from ggrun.core.llm.session_caches import apply_k_shift, k_shift_graph, kv_bytes_by_backend, make_caches
from ggrun.core.llm.session_params import SessionParams
from ggrun.core.sched import ScheduledGraph, Scheduler


class KVCacheFull(RuntimeFailure):
    """No free cells for a micro-batch; a caller that schedules sequences waits and retries."""


@dataclass
class SessionStats:
    """What a session did: graphs built and reused (each decision in reuse_log), seconds spent building,
    planning and computing, tokens decoded."""

    graphs_built: int = 0
    graphs_reused: int = 0
    build_s: float = 0.0
    plan_s: float = 0.0
    compute_s: float = 0.0
    n_tokens: int = 0  # tokens decoded (micro-batches computed), for timings of an interrupted batch
    reuse_log: list[tuple[bool, str]] = field(default_factory=list)


MAX_COPIES = 4  # llama.cpp's GGML_SCHED_MAX_COPIES


def pipeline_copies(model: Model) -> int:
    """llama.cpp's n_copies: GGRUN_SCHED_MAX_COPIES (default 4) pipeline slots when the model's layers
    are split over several devices with everything offloaded (so micro-batches can overlap across
    them), else 1."""
    if not model.placement.pipeline_parallel:
        return 1
    try:
        return max(1, int(os.environ.get("GGRUN_SCHED_MAX_COPIES", MAX_COPIES)))
    except ValueError:
        return MAX_COPIES


@np.errstate(all="ignore")
def _compute_quietly(sched: Scheduler, sg: ScheduledGraph) -> None:
    """Compute a graph with numpy's floating-point warnings off: a NaN is reported once, by the logits'
    finite check, not as warnings per kernel. errstate as a decorator, as it costs half of a `with` block
    (each decode step enters it)."""
    sched.compute(sg)


class InFlight:
    """A decode left computing (Session.decode_begin): calling it waits for what it gives back, once."""

    def __init__(self, collect: Callable[[], np.ndarray | None]) -> None:
        self._collect: Callable[[], np.ndarray | None] | None = collect
        self._out: np.ndarray | None = None

    def __call__(self) -> np.ndarray | None:
        if self._collect is not None:
            collect, self._collect = self._collect, None
            self._out = collect()
        return self._out


def _check_rows(batch: Batch, rows: SamplingRows) -> None:
    """A sampling row for each token of the batch that asks logits."""
    n_out = int(np.count_nonzero(batch.logits))
    if len(rows) != n_out:
        raise ValueError(f"{len(rows)} sampling rows for {n_out} rows of logits")


def _joined(outs: list[np.ndarray | None]) -> np.ndarray:
    """The token ids of a batch's micro-batches, in order (i32; none: empty), in an array of their own (a
    graph's output, as the CPU's, is written again by its next run)."""
    outs = [o for o in outs if o is not None]
    return np.concatenate(outs) if len(outs) > 1 else np.array(outs[0]) if outs else np.zeros(0, dtype=np.int32)


class Session:
    """Decode batches of tokens for a model; logits come back for the tokens that asked."""

    def __init__(self, model: Model, params: SessionParams) -> None:
        params.check()
        self.model = model
        self.params = params
        self.n_ubatch = min(params.n_ubatch, params.n_batch)
        n_copies = params.n_copies if params.n_copies is not None else pipeline_copies(model)
        self.sched = Scheduler(model.backends, params.reuse_memory, n_copies)
        self.virtual = any(c.virtual for c in model.contexts.values())  # metadata-only model: plan, never run
        # what each memory pool has free before the session takes anything (a plan-only session takes nothing)
        self.budget = None if self.virtual else Budget.now(model.backends)
        # the bytes each backend's KV cache takes, checked against the budget (none for a plan-only session)
        self.kv, self.kv_swa, self.kv_need = make_caches(model, params, self.n_ubatch, self.virtual, self.budget,
                                                         self.sched.cpu.name)
        # the KV cache, and the sliding-window one after it when there is one (every decode step walks them)
        self.caches: tuple[KVCache, ...] = (self.kv,) if self.kv_swa is None else (self.kv, self.kv_swa)
        self.seq_words = self.mask_seq_words()
        for cache in self.caches:  # masks made from the cells cost little per cell: shapes in powers of two
            cache.pow2_cells = self.seq_words > 0
        self.graph_reuse = params.graph_reuse and reuse_enabled_by_env()
        self.debug = graph_debug_level()
        self.check_numerics = params.check_numerics or self.debug >= 1
        self.stats = SessionStats()
        self.graphs = GraphCache()
        self._debug_line = ""
        self.interrupt: Callable[[], bool] | None = None  # polled before each micro-batch (Ctrl-C)
        self._ready: ReadyStep | None = None  # the next decode step, readied during the last (ready_step.py)
        self._kept_logits: list[np.ndarray] | None = None  # decode_sampled's logits, when asked for
        self._kept_logprobs: list[np.ndarray] | None = None  # decode_sampled_logprobs' values, when asked for
        self._n_probs = -1  # the likeliest tokens decode_sampled_logprobs asks for (-1: none)
        self._inflight: InFlight | None = None  # decode_begin's last micro-batch, still computing
        self.reserved = {} if self.virtual else self.reserve()

    def kv_bytes_by_backend(self) -> dict[str, int]:
        """Bytes of K and V rows the session's caches hold on each backend."""
        return kv_bytes_by_backend(self.caches)

    def mask_seq_words(self) -> int:
        """The i32 words of sequence bits a cell takes when the KQ masks are made where attention runs from the
        cells (inputs.KQMaskFromCells), else 0 (host-filled masks). Made from the cells when
        SessionParams.mask_from_cells says so, or (None) when several sequences share a cache held off the CPU,
        unless GGRUN_MASK_FROM_CELLS=0: a host-filled mask of 128 sequences' decode step over their 32k cells
        took the host 11 ms of an 18 ms step (H200, llama-1b), a prompt chunk's of 512 tokens more; the cells'
        positions and bits take a fraction, and n_kv in powers of two keeps a prompt's chunks on few graphs.
        The CPU's reference kernel makes exactly the host's masks (tests/llm/test_inputs.py), the CUDA kernel
        too (tests/core/test_cuda_batched.py)."""
        on = self.params.mask_from_cells
        if on is None:
            on = (os.environ.get("GGRUN_MASK_FROM_CELLS", "1") != "0" and self.params.n_seq_max > 1
                  and any(name != self.sched.cpu.name for name in self.kv_bytes_by_backend()))
        return -(-self.params.n_seq_max // 32) if on else 0

    @property
    def kv_version(self) -> tuple[int, ...]:
        return tuple([c.version for c in self.caches])

    @property
    def n_ctx(self) -> int:
        return self.params.n_ctx

    def worst_case_params(self, all_logits: bool = True) -> GraphParams:
        """The largest decode graph this session can run (reservation.worst_case_params)."""
        return reservation.worst_case_params(self.n_ubatch, self.n_ctx,
                                             self.kv_swa.n_ctx if self.kv_swa is not None else 0, all_logits)

    def build(self, p: GraphParams) -> GraphResult:
        """Build and schedule (not allocate) the decode graph for params p."""
        inputs = GraphInputs.for_params(p, self.model.hp.extra.get("swa_window"), self.seq_words)
        model = self.model
        build = Build(model.hp, inputs, self.kv, p, self.params.flash_attn, model.numerics == "llama", self.kv_swa,
                      model.arch.rope_factors(model.weights, model.hp, self.kv.n_ctx))
        logits = model.arch.build(build, model.weights)
        tokens = ops.argmax(logits, name="result_argmax") if p.greedy else None
        logprobs = None
        if p.sampler:
            tokens = ops.sample(logits, *(i.tensor for i in inputs.sampling), name="result_sample")
            if p.n_probs >= 0:
                logprobs = ops.sample_logprobs(logits, tokens, p.n_probs, name="result_logprobs")
        graph = build_graph([t for t in (logits, tokens, logprobs) if t is not None])
        sg = self.sched.schedule(graph)
        # only inputs the graph reads get memory: a gemma3 of fewer than 6 layers has no global layer,
        # so nothing reads the global cache's rows or mask
        read = {id(t) for t in graph.leafs}
        used = [i for i in inputs.all() if id(i.tensor) in read]
        return GraphResult(p, used, logits, sg, self.kv_version, self.sched.generation, tokens, logprobs)

    def plan_worst_case(self, all_logits: bool = True) -> tuple[GraphResult, dict, float]:
        """Build and measure the worst-case graph without allocating: (graph, plans, plan seconds)."""
        return reservation.plan_worst_case(self.sched, self.build, self.worst_case_params(all_logits))

    def reserve(self) -> dict:
        """Reserve every backend's compute buffer for the largest graph this session can run, the K-shift
        graphs included (reservation.reserve), so buffers exist before the first token and never grow."""
        k_shifts = (k_shift_graph(self.model, c)[0] for c in self.caches)
        return reservation.reserve(self.sched, self.build, self.worst_case_params(), k_shifts, self.budget,
                                   self.kv_need)

    def reset_scheduler(self) -> None:
        """Drop compute buffers and re-reserve; a kept graph is stale afterwards."""
        self.sched.reset()
        self.reserved = self.reserve()

    # ---- decoding ---------------------------------------------------------------------

    def decode(self, batch: Batch) -> np.ndarray:
        """Evaluate `batch`; returns logits [tokens that asked for them, n_vocab] in batch order."""
        outs = self._decode(batch, greedy=False)
        if not outs:
            return np.zeros((0, self.model.hp.n_vocab), dtype=np.float32)
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def decode_greedy(self, batch: Batch) -> np.ndarray:
        """Evaluate `batch` as decode does, choosing each next token where the logits are computed: returns the
        argmax of each row of logits (i32 [tokens that asked for them], in batch order), and only those ids
        come back to the host. Non-finite logits raise NonFiniteLogits as in decode."""
        outs = self._decode(batch, greedy=True)
        return np.concatenate(outs) if outs else np.zeros(0, dtype=np.int32)

    def decode_sampled(self, batch: Batch, rows: SamplingRows,
                       with_logits: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Evaluate `batch` as decode does, drawing each next token where the logits are computed by
        llama.cpp's sampler chain (ops.sample) with row i of `rows` for the i-th token asking logits: returns
        the token ids (i32, in batch order), and only those come back to the host, unless with_logits asks
        for the logits too (then: ids, logits). Non-finite logits raise NonFiniteLogits as in decode."""
        _check_rows(batch, rows)
        self._kept_logits = [] if with_logits else None
        try:
            outs = self._decode(batch, greedy=False, sampling=rows)
            kept = self._kept_logits
        finally:
            self._kept_logits = None
        ids = np.concatenate(outs) if outs else np.zeros(0, dtype=np.int32)
        if not with_logits:
            return ids
        return ids, (np.concatenate(kept) if kept else np.zeros((0, self.model.hp.n_vocab), dtype=np.float32))

    def decode_begin(self, batch: Batch, rows: SamplingRows | None = None, ahead: int = 0,
                     tokens: Callable[[], np.ndarray] | None = None) -> "InFlight":
        """decode_greedy (rows None) or decode_sampled with the batch's last micro-batch left computing: returns
        what waits for the token ids (all of the batch's, in order). The host does other work meanwhile (parallel
        settles the step before: its texts, its finished sequences); the session's next decode waits for it
        first. `ahead`: prompt tokens the caller will decode in later batches (a prompt read in chunks), which
        the cells attended make room for as for a batch's later micro-batches (KVCache.n_kv), so that the
        prompt's chunks share a graph. `tokens`: the batch's token ids given late (batch.tokens only holds their
        place), asked for once everything else a readied step needs is done, the decode in flight waited for
        first: parallel's next step, whose tokens are the ids of the step in flight, so that the host's work
        for it (its cells recorded, its sampling rows written: ~50 us at 64 tokens) is not time the device waits."""
        if rows is not None:
            _check_rows(batch, rows)
        outs = self._decode(batch, greedy=rows is None, sampling=rows, defer=True, ahead=ahead, tokens=tokens)
        last = self._inflight
        self._inflight = InFlight(lambda: _joined(outs + ([last()] if last is not None else [])))
        return self._inflight

    def decode_sampled_logprobs(self, batch: Batch, rows: SamplingRows, n_probs: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """decode_sampled that also reports ops.sample_logprobs for each drawn token: (ids, f32 [rows,
        1 + 2 n_probs]: the token's log-probability, then the n_probs likeliest (id, log-probability) pairs),
        computed where the logits are; those values come back instead of the logits."""
        if n_probs < 0:
            raise BadInput(f"n_probs {n_probs} must not be negative")
        self._kept_logprobs, self._n_probs = [], n_probs
        try:
            ids = self.decode_sampled(batch, rows)
            kept = self._kept_logprobs
        finally:
            self._kept_logprobs, self._n_probs = None, -1
        return ids, (np.concatenate(kept) if kept else np.zeros((0, 1 + 2 * n_probs), dtype=np.float32))

    def _decode(self, batch: Batch, greedy: bool, sampling: SamplingRows | None = None,
                defer: bool = False, ahead: int = 0,
                tokens: Callable[[], np.ndarray] | None = None) -> list[np.ndarray]:
        """What each micro-batch of `batch` that asked for logits gives back (_fetch), in order; with greedy,
        graphs end in the logits' argmax, with sampling in ops.sample. With defer the last micro-batch is left
        computing (in _inflight, not in the list). A decode left computing before is waited for first; with
        `tokens` (decode_begin's), for a readied step only once its other inputs are written."""
        if tokens is None:
            self._given(batch)
        ready, self._ready = self._ready, None
        if ready is not None and self._serves(ready, batch, greedy, sampling):
            if self.interrupt is not None and self.interrupt():
                raise Interrupted()
            out = self._take(ready, batch, sampling, defer, tokens)
            return [] if defer else [out]
        if tokens is not None:
            self._given(batch, tokens)
        outs = []
        row, ahead = 0, len(batch) + ahead
        ubs = split_batch(batch, self.n_ubatch)
        for i, ub in enumerate(ubs):
            if self.interrupt is not None and self.interrupt():
                raise Interrupted()
            rows = sampling.slice(row, row + ub.n_outputs) if sampling is not None and ub.n_outputs else None
            row += ub.n_outputs
            ahead -= ub.n_tokens
            left = defer and i == len(ubs) - 1  # the batch's last micro-batch, left computing
            out = self._decode_ubatch(ub, greedy, rows, ahead, left)
            if out is not None and not left:
                outs.append(out)
        return outs

    def _serves(self, ready: ReadyStep, batch: Batch, greedy: bool, sampling: SamplingRows | None) -> bool:
        """Whether the readied step is this batch's, decoded as asked (greedy or not, sampled with rows of its
        shape and its log-probabilities or not)."""
        n_probs = self._n_probs if sampling is not None else -1
        return (ready.params.greedy == greedy and ready.params.n_probs == n_probs
                and ready.serves(batch, stamp(self.kv, self.sched), sampling.shape_key if sampling is not None else ()))

    def _fetch(self, res: GraphResult, sampling: SamplingRows | None = None) -> tuple[np.ndarray, bool]:
        """What a computed micro-batch gives back and whether its logits are finite: the logits, or from a graph
        ending in their argmax (decode_greedy's) or in ops.sample the token ids. A row marked -1 brings the
        logits back instead, for the error to say what they hold; a row the GPU's sampler leaves to the host
        (more candidates than it sorts: ops.SAMPLE_ON_HOST) is sampled from its own logits here."""
        if res.tokens is None:
            return self.sched.get_checked(res.logits)
        ids = self.sched.get_tensor(res.tokens)
        if min(ids.tolist()) < 0:  # a few ids: numpy's any() costs a step some 2.5 us of host time
            if sampling is None or np.any(ids == -1):
                return self.sched.get_tensor(res.logits), False
            ids, logits = np.array(ids), self.sched.get_tensor(res.logits)
            for r in np.flatnonzero(ids == ops.SAMPLE_ON_HOST).tolist():
                ids[r] = sample_on_host(np.asarray(logits[r]), sampling, r)
        return ids, True

    @property
    def logits_on_device(self) -> bool:
        """Whether the logits are computed off the host (the output head on a GPU), where decode_greedy saves
        bringing them back each step; on the CPU they are in host memory already."""
        return self.model.placement.output is not self.model.placement.input

    def _check_batch(self, batch: Batch) -> None:
        """Every token id must be in the vocabulary (min and max of the list: no array made for it)."""
        toks = batch.tokens
        if isinstance(toks, np.ndarray):
            if len(toks) and (int(toks.min()) < 0 or int(toks.max()) >= self.model.hp.n_vocab):
                raise BadInput(f"token id out of range 0..{self.model.hp.n_vocab - 1}")
        elif len(toks) and (min(toks) < 0 or max(toks) >= self.model.hp.n_vocab):
            raise BadInput(f"token id out of range 0..{self.model.hp.n_vocab - 1}")

    def place_ubatch(self, ub: UBatch) -> UBatchState:
        """Find cells for the micro-batch in every cache and record them there (the window cache first
        frees what no token can see any more); KVCacheFull when the cache cannot hold it."""
        if self.kv_swa is not None:
            self.kv_swa.evict_unseen(ub.pos, ub.seq)
        n = ub.n_tokens
        cells = []
        for cache in self.caches:  # every cache has room before any records the micro-batch
            x = cache.find_slot(n, ub.seq)
            if x is None:
                raise KVCacheFull(f"the KV cache ({self.n_ctx} cells, {self.kv.n_free()} free) cannot hold "
                                  f"{n} more tokens")
            cells.append(x)
        for cache, x in zip(self.caches, cells):
            cache.apply(x, ub.pos, ub.seq)
        if self.kv_swa is None:
            return UBatchState(ub, cells[0], self.kv)
        return UBatchState(ub, cells[0], self.kv, cells[1], self.kv_swa)

    def _decode_ubatch(self, ub: UBatch, greedy: bool, sampling: SamplingRows | None = None,
                       ahead: int = 0, defer: bool = False) -> np.ndarray | None:
        """Place and run one micro-batch; `ahead`: the batch's tokens in later micro-batches (KVCache.n_kv);
        defer: leave it computing (_run)."""
        for cache in self.caches:  # keys move to their shifted positions before any cell is reused
            if cache.has_shift:
                apply_k_shift(self.model, self.sched, cache)
        one_per_seq = wants_bucket(ub)
        placed = self.place_ubatch(ub)
        drawn = greedy or (sampling is not None and self._kept_logits is None)
        st = self._padded(placed, one_per_seq, drawn)
        if sampling is not None:
            st = replace(st, sampling=sampling)
        ub = st.ub
        p = GraphParams(ub.n_tokens, ub.n_outputs, self.kv.n_kv(ahead, one_per_seq), self.kv_swa.n_kv() if self.kv_swa is not None else 0,
                        greedy and ub.n_outputs > 0, sampling.shape_key if sampling is not None else (), one_per_seq,
                        self._n_probs if sampling is not None else -1, one_per_seq and shares_prefix(ub, self.kv))
        lent = self.graphs.borrow(p, self.kv_version, self.sched.generation) if self.seq_words and self.graph_reuse else None
        own = None
        if lent is not None:
            wide = self._padded(placed, one_per_seq, drawn, lent.params)
            if (wide.ub.n_tokens, wide.ub.n_outputs) == (lent.params.n_tokens, lent.params.n_outputs):
                st, p, own = replace(wide, sampling=st.sampling), lent.params, p
        res = self._graph_for(p, own)
        t0 = time.perf_counter()
        res.set_inputs(st, self.sched.cpu)
        return self._run(st, res, t0, defer)

    def _padded(self, st: UBatchState, one_per_seq: bool, drawn: bool, to: GraphParams | None = None) -> UBatchState:
        """A placed micro-batch padded to its bucket (a decode step of many sequences: buckets.pad_state), or in a
        session of many sequences off the CPU a mixed step or prompt to powers of two (buckets.pad_mixed; `drawn`:
        its tokens drawn in the graph); to the tokens and outputs of `to` instead, where given (a larger graph,
        GraphCache.borrow)."""
        size, outs = (to.n_tokens, to.n_outputs) if to is not None else (None, None)
        if one_per_seq:
            return pad_state(st, self.n_ubatch, size)
        if self.seq_words:
            return pad_mixed(st, self.n_ubatch, drawn, size, outs)
        return st

    def _take(self, ready: ReadyStep, batch: Batch, sampling: SamplingRows | None, defer: bool = False,
              tokens: Callable[[], np.ndarray] | None = None) -> np.ndarray | None:
        """Decode the step readied during the last one (ready_step.py): its sampling rows written, its cells
        recorded, then its tokens (given late: asked for only now, _given) written."""
        t0 = time.perf_counter()
        st = ready.take(sampling)
        n = ready.n
        self.kv.apply(st.cells[:n], st.ub.pos[:n], st.ub.seq[:n], free=True)
        if tokens is not None:
            self._given(batch, tokens)
        ready.write(batch.tokens)
        self._reused(ready.params, ready.res)
        return self._run(st, ready.res, t0, defer)

    def _given(self, batch: Batch, tokens: Callable[[], np.ndarray] | None = None) -> None:
        """Wait for the decode in flight, if any; then the batch's token ids (asked of `tokens` where given late),
        checked."""
        if self._inflight is not None:
            self._inflight()
            self._inflight = None
        if tokens is not None:
            batch.tokens = tokens()
        self._check_batch(batch)

    def _run(self, st: UBatchState, res: GraphResult, t0: float, defer: bool = False) -> np.ndarray | None:
        """Compute a micro-batch whose inputs are filled (since t0); while the device works, ready the next
        step of a decode step (ready_step.readies); its logits, or with defer None and what waits for them in
        _inflight."""
        _compute_quietly(self.sched, res.sg)
        if readies(st.ub, res.params):
            self._ready = self._ready_next(st, res)
        if defer:
            self._inflight = InFlight(partial(self._collect, st, res, t0))
            return None
        return self._collect(st, res, t0)

    def _collect(self, st: UBatchState, res: GraphResult, t0: float) -> np.ndarray | None:
        """What a launched micro-batch gives back (_fetch), once its device is done, with its time and checks."""
        ub = st.ub
        out, finite = self._fetch(res, st.sampling) if ub.n_outputs else (None, True)
        dt = time.perf_counter() - t0
        self.stats.compute_s += dt
        self.stats.n_tokens += ub.n_real
        if self.debug:  # one line per micro-batch, printed once its compute time is known
            print_ubatch(self._debug_line, ub, dt, self.debug)
        if not finite:
            self._ready = None  # the culprit's search fills the inputs again
            raise self._non_finite(ub, out, res, partial(res.set_inputs, st, self.sched.cpu))
        real = ub.n_real_outputs
        if self._kept_logits is not None and ub.n_outputs:
            self._kept_logits.append(np.array(self.sched.get_tensor(res.logits)[:real]))
        if self._kept_logprobs is not None and ub.n_outputs:
            self._kept_logprobs.append(self._logprobs(res, out[:real]))
        return out[:real] if ub.n_out_pad else out

    def _ready_next(self, st: UBatchState, res: GraphResult) -> ReadyStep | None:
        """The next decode step after st's, readied while the device computes st's (ready_step.py)."""
        return ready_next(st, res, self.caches, self.sched, self.graph_reuse, self.n_ubatch)

    def _logprobs(self, res: GraphResult, ids: np.ndarray) -> np.ndarray:
        """The micro-batch's ops.sample_logprobs rows; a row whose token the host drew (ops.SAMPLE_ON_HOST: the
        graph saw no id) gets its token's log-probability from its logits here."""
        lp = np.array(self.sched.get_tensor(res.logprobs)[:len(ids)])
        missing = np.flatnonzero(np.isnan(lp[:, 0]))
        if len(missing):
            logits = np.asarray(self.sched.get_tensor(res.logits)[missing], dtype=np.float64)
            shifted = logits - logits.max(axis=1, keepdims=True)
            own = shifted[np.arange(len(missing)), ids[missing]]
            lp[missing, 0] = own - np.log(np.exp(shifted).sum(axis=1))
        return lp

    def _non_finite(self, ub: UBatch, logits: np.ndarray, res: GraphResult,
                    set_inputs: Callable[[], None]) -> NonFiniteLogits:
        """The error for non-finite logits of micro-batch ub; with check_numerics, naming the first
        node that produced a non-finite value (the micro-batch is recomputed node by node)."""
        p0, p1 = int(ub.pos[:ub.n_real].min()), int(ub.pos[:ub.n_real].max())
        where = f"at position {p0}" if p0 == p1 else f"at positions {p0}..{p1}"
        culprit = None
        if self.check_numerics:
            with np.errstate(all="ignore"):
                culprit = first_non_finite(res.sg, set_inputs) or "no graph node holds one when recomputed"
        return NonFiniteLogits(non_finite_kind(logits), where, culprit, source=str(self.model.path))

    def _graph_for(self, p: GraphParams, lent_for: GraphParams | None = None) -> GraphResult:
        """A kept graph that can serve p, else a newly built and planned one (kept in turn); `lent_for`: the params
        of the micro-batch's own shape, where it runs a larger kept graph (GraphCache.borrow)."""
        res, decision = self.graphs.take(p, self.kv_version, self.sched.generation, self.graph_reuse)
        if res is not None:
            self._reused(p, res, lent_for)
            return res
        t0 = time.perf_counter()
        res = self.build(p)
        t1 = time.perf_counter()
        self.sched.alloc(res.sg)
        t2 = time.perf_counter()
        self.stats.graphs_built += 1
        self.stats.build_s += t1 - t0
        self.stats.plan_s += t2 - t1
        self.graphs.keep(res, self.graph_reuse)
        self._log(decision, p, res, (t1 - t0, t2 - t1))
        return res

    @property
    def result(self) -> GraphResult | None:
        """The graph the last micro-batch ran."""
        return self.graphs.last

    def _reused(self, p: GraphParams, res: GraphResult, lent_for: GraphParams | None = None) -> None:
        """Count and record a graph reused for params p (taken back from the kept ones, or readied; lent to a
        micro-batch of params `lent_for`, padded further)."""
        self.stats.graphs_reused += 1
        said = REUSED if lent_for is None else Decision(True, f"lent to n_tokens {lent_for.n_tokens}, "
                                                              f"n_outputs {lent_for.n_outputs}")
        self._log(said, p, res, (0.0, 0.0))

    def _log(self, decision: Decision, p: GraphParams, res: GraphResult, times: tuple[float, float]) -> None:
        """Record the reuse decision; with GGRUN_GRAPH_DEBUG, keep its line for _run to print."""
        self.stats.reuse_log.append((decision.reuse, decision.said))
        if self.debug:
            self._debug_line = decision_line(decision.said, p, res, self.sched, times, self.debug)

    # ---- sequences --------------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        for cache in self.caches:
            cache.seq_rm(seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        for cache in self.caches:
            cache.seq_cp(src, dst, p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        for cache in self.caches:
            cache.seq_add(seq, p0, p1, delta)

    def clear(self) -> None:
        for cache in self.caches:
            cache.clear()
