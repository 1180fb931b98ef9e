"""A session: one model, one KV cache, one scheduler; decodes batches micro-batch by
micro-batch, reusing the previous graph whenever the next one would have the same shapes.

At creation it reserves the worst-case graph (n_ubatch tokens over the full context), so
compute buffers exist before the first token and do not grow while generating; the KV cache and
those buffers are first checked to fit in the memory free (core.llm.budget). Logits that hold NaN
or infinity stop decoding (core.llm.numerics), never reach a sampler. A caller may set `interrupt`, a
poll asked before each micro-batch: when it says stop, decode raises Interrupted with the cache holding
exactly the micro-batches already computed.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import numpy as np

from ggrun.core import ops
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput, Interrupted, RuntimeFailure
from ggrun.core.graph import build_graph
from ggrun.core.llm.batch import Batch, UBatch, split_batch
from ggrun.core.llm.batched_sampler import SamplingRows, sample_on_host
from ggrun.core.llm.buckets import pad_state, wants_bucket
from ggrun.core.llm.blocks import Build, build_k_shift
from ggrun.core.llm.graph_result import GraphCache, GraphResult
from ggrun.core.llm.inputs import GraphInputs, GraphParams, UBatchState
from ggrun.core.llm.budget import Budget
from ggrun.core.llm.kv_cache import (build_k_shift_blocks, cell_record_bytes, check_cache_types, KV_PAD, KVCache,
                                     planned_bytes)
from ggrun.core.llm.model import Model
from ggrun.core.llm.numerics import NonFiniteLogits, first_non_finite, non_finite_kind
from ggrun.core.llm.ready_step import ReadyStep
from ggrun.core.sched import ScheduledGraph, Scheduler


class KVCacheFull(RuntimeFailure):
    """No free cells for a micro-batch; a caller that schedules sequences waits and retries."""


@dataclass(frozen=True)
class SessionParams:
    n_ctx: int = 2048
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    type_k: DType = DType.F16  # KV cache types (llama.cpp's -ctk / -ctv)
    type_v: DType = DType.F16
    graph_reuse: bool = True
    reuse_memory: bool = True  # False: every intermediate gets its own bytes (a reference run)
    flash_attn: bool = True  # fused attention op (llama.cpp's -fa, on by default as its "auto" on the CPU)
    check_numerics: bool = False  # on non-finite logits, find the node that made them (also GGRUN_GRAPH_DEBUG)
    n_copies: int | None = None  # pipeline slots; None: llama.cpp's rule (pipeline_copies)

    def check(self) -> None:
        if self.n_ctx < 1:
            raise BadInput(f"context size -c {self.n_ctx} must be positive")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise BadInput(f"batch sizes must be positive (-b {self.n_batch}, -ub {self.n_ubatch})")
        if self.n_seq_max < 1:
            raise BadInput(f"number of sequences {self.n_seq_max} must be positive")


@dataclass
class SessionStats:
    graphs_built: int = 0
    graphs_reused: int = 0
    build_s: float = 0.0
    plan_s: float = 0.0
    compute_s: float = 0.0
    n_tokens: int = 0  # tokens decoded (micro-batches computed), for timings of an interrupted batch
    reuse_log: list[tuple[bool, str]] = field(default_factory=list)


def graph_debug_level() -> int:
    try:
        return int(os.environ.get("GGRUN_GRAPH_DEBUG", "0") or 0)
    except ValueError:
        return 0


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


def reuse_enabled_by_env() -> bool:
    return os.environ.get("GGRUN_GRAPH_REUSE", "1") not in ("0", "false", "no")


@np.errstate(all="ignore")
def _compute_quietly(sched: Scheduler, sg: ScheduledGraph) -> None:
    """Compute a graph with numpy's floating-point warnings off: a NaN is reported once, by the logits'
    finite check, not as warnings per kernel. errstate as a decorator, as it costs half of a `with` block
    (each decode step enters it)."""
    sched.compute(sg)


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
        self.kv_need: dict[str, int] = {}
        self.kv, self.kv_swa = self._make_caches()
        # the KV cache, and the sliding-window one after it when there is one (every decode step walks them)
        self.caches: tuple[KVCache, ...] = (self.kv,) if self.kv_swa is None else (self.kv, self.kv_swa)
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
        self.reserved = {} if self.virtual else self.reserve()

    def _make_caches(self) -> tuple[KVCache, KVCache | None]:
        """The KV cache, and for an architecture with sliding-window layers (gemma3) a second one for
        those layers sized to the window (llama.cpp's iSWA: n_swa * n_seq + n_ubatch cells, padded),
        so their memory and attention work stop growing with the context."""
        model, p = self.model, self.params
        swa = model.arch.swa_layers(model.hp)
        window = model.hp.extra.get("swa_window")
        check_cache_types(p.type_k, p.type_v, model.hp.head_dim, p.flash_attn)
        kw = dict(n_seq_max=p.n_seq_max, type_k=p.type_k, type_v=p.type_v, head_dim=model.hp.head_dim,
                  virtual=self.virtual, llama_numerics=model.numerics == "llama")
        layers = model.placement.layers
        if not any(swa):
            specs = [dict(n_ctx=p.n_ctx, n_embd_kv=model.hp.n_embd_kv, layer_backends=layers, **kw)]
        else:
            n_swa = min(p.n_ctx, -(-(window * p.n_seq_max + self.n_ubatch) // KV_PAD) * KV_PAD)
            specs = [dict(n_ctx=p.n_ctx, n_embd_kv=model.hp.n_embd_kv,
                          layer_backends=[None if w else b for w, b in zip(swa, layers)], **kw),
                     dict(n_ctx=n_swa, n_embd_kv=model.hp.n_embd_kv,
                          layer_backends=[b if w else None for w, b in zip(swa, layers)], **kw,
                          window=window, name="cache_swa")]
        if self.budget is not None:  # the cache must fit before it is allocated (-c can ask for terabytes)
            self.kv_need = self._kv_need(specs)
            self.budget.check({"KV cache": self.kv_need})
        caches = [KVCache(**spec) for spec in specs]
        return caches[0], caches[1] if len(caches) > 1 else None

    def _kv_need(self, specs: list[dict]) -> dict[str, int]:
        """Bytes per backend the caches of `specs` will take: K and V rows, and the cell records on the host."""
        need: dict[str, int] = {}
        for spec in specs:
            for name, n in planned_bytes(**spec).items():
                need[name] = need.get(name, 0) + n
            cpu = self.sched.cpu.name
            need[cpu] = need.get(cpu, 0) + spec["n_ctx"] * cell_record_bytes(spec["n_seq_max"])
        return need

    def kv_bytes_by_backend(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for cache in self.caches:
            for name, n in cache.bytes_by_backend().items():
                out[name] = out.get(name, 0) + n
        return out

    @property
    def kv_version(self) -> tuple[int, ...]:
        return tuple([c.version for c in self.caches])

    @property
    def n_ctx(self) -> int:
        return self.params.n_ctx

    def worst_case_params(self, all_logits: bool = True) -> GraphParams:
        n = min(self.n_ubatch, self.n_ctx)
        return GraphParams(n_tokens=n, n_outputs=n if all_logits else 1, n_kv=self.n_ctx,
                           n_kv_swa=self.kv_swa.n_ctx if self.kv_swa is not None else 0)

    def build(self, p: GraphParams) -> GraphResult:
        """Build and schedule (not allocate) the decode graph for params p."""
        inputs = GraphInputs.for_params(p, self.model.hp.extra.get("swa_window"))
        build = Build(self.model.hp, inputs, self.kv, p, self.params.flash_attn, self.model.numerics == "llama",
                      self.kv_swa)
        logits = self.model.arch.build(build, self.model.weights)
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
        res = self.build(self.worst_case_params(all_logits))
        t0 = time.perf_counter()
        plans = self.sched.measure(res.sg)
        return res, plans, time.perf_counter() - t0

    def reserve(self) -> dict:
        """Reserve every backend's compute buffer for the largest graph this session can run, so that
        buffers exist before the first token and never grow while generating.

        That is n_ubatch tokens over the full context, but the worst number of logit rows is not
        obvious: fewer rows than tokens adds the output-row input and get_rows results that live
        beside their sources, so logits for all tokens but one can need more than logits for all
        (or for one). The K-shift graph (after seq_add) holds a rotated copy of one layer's keys
        over all cells, the largest of all when n_ubatch is small. Each is measured, and the
        largest reserved first, so that one allocation per backend is the usual case; a graph that
        fits in what is reserved already is not planned a second time (it would allocate nothing)."""
        worst = self.worst_case_params()
        n = worst.n_tokens
        graphs = [self.build(GraphParams(n, k, worst.n_kv, worst.n_kv_swa)).sg
                  for k in sorted({n, max(n - 1, 1), 1}, reverse=True)]
        graphs += [self.sched.schedule(self._k_shift_graph(c)[0]) for c in self.caches]
        measured = [self.sched.measure(sg) for sg in graphs]
        need = [sum(p.size for p in m.values()) for m in measured]
        if self.budget is not None:  # the compute buffers must fit beside the cache before they are allocated
            compute: dict[str, int] = {}
            for m in measured:
                for name, plan in m.items():
                    compute[name] = max(compute.get(name, 0), plan.size)
            self.budget.check({"KV cache": self.kv_need, "compute buffers": compute})
        plans: dict = {}
        for i in sorted(range(len(graphs)), key=lambda i: -need[i]):
            if plans and all(name in plans and m.size <= plans[name].size for name, m in measured[i].items()):
                continue
            for name, plan in self.sched.reserve(graphs[i]).items():
                if name not in plans or plan.size > plans[name].size:
                    plans[name] = plan
        return plans

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
        n_out = int(np.count_nonzero(batch.logits))
        if len(rows) != n_out:
            raise ValueError(f"{len(rows)} sampling rows for {n_out} rows of logits")
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

    def _decode(self, batch: Batch, greedy: bool, sampling: SamplingRows | None = None) -> list[np.ndarray]:
        """What each micro-batch of `batch` that asked for logits gives back (_fetch), in order; with greedy,
        graphs end in the logits' argmax, with sampling in ops.sample."""
        self._check_batch(batch)
        ready, self._ready = self._ready, None
        if (ready is not None and sampling is None and ready.params.greedy == greedy
                and ready.serves(batch, self._stamp())):
            if self.interrupt is not None and self.interrupt():
                raise Interrupted()
            return [self._take(ready, batch)]
        outs = []
        row = 0
        for ub in split_batch(batch, self.n_ubatch):
            if self.interrupt is not None and self.interrupt():
                raise Interrupted()
            rows = sampling.slice(row, row + ub.n_outputs) if sampling is not None and ub.n_outputs else None
            row += ub.n_outputs
            out = self._decode_ubatch(ub, greedy, rows)
            if out is not None:
                outs.append(out)
        return outs

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

    def _decode_ubatch(self, ub: UBatch, greedy: bool, sampling: SamplingRows | None = None) -> np.ndarray | None:
        for cache in self.caches:  # keys move to their shifted positions before any cell is reused
            if cache.has_shift:
                self._apply_k_shift(cache)
        one_per_seq = wants_bucket(ub)
        st = pad_state(self.place_ubatch(ub), self.n_ubatch)
        if sampling is not None:
            st = replace(st, sampling=sampling)
        ub = st.ub
        p = GraphParams(ub.n_tokens, ub.n_outputs, self.kv.n_kv(), self.kv_swa.n_kv() if self.kv_swa is not None else 0,
                        greedy and ub.n_outputs > 0, sampling.shape_key if sampling is not None else (), one_per_seq,
                        self._n_probs if sampling is not None else -1)
        res = self._graph_for(p)
        t0 = time.perf_counter()
        res.set_inputs(st, self.sched.cpu)
        return self._run(st, res, t0)

    def _take(self, ready: ReadyStep, batch: Batch) -> np.ndarray:
        """Decode the step readied during the last one (ready_step.py): its cell recorded, its token written."""
        t0 = time.perf_counter()
        ub = ready.take(batch)
        self.kv.apply_one(ready.cell, ready.pos, ready.seq)
        self._reused(ready.params, ready.res)
        return self._run(UBatchState(ub, ready.cells, self.kv), ready.res, t0)

    def _run(self, st: UBatchState, res: GraphResult, t0: float) -> np.ndarray | None:
        """Compute a micro-batch whose inputs are filled (since t0); while the device works, ready the next
        step of a one-token one; its logits."""
        ub = st.ub
        _compute_quietly(self.sched, res.sg)
        if ub.n_tokens == 1 and ub.n_outputs == 1:
            self._ready = self._ready_next(st, res)
        out, finite = self._fetch(res, st.sampling) if ub.n_outputs else (None, True)
        dt = time.perf_counter() - t0
        self.stats.compute_s += dt
        self.stats.n_tokens += ub.n_real
        if self.debug:  # one line per micro-batch, printed once its compute time is known
            pad = f" bucket {ub.n_tokens} ({ub.n_real} + {ub.n_pad} padding)" if ub.n_pad else ""
            print(self._debug_line + pad + (f" compute {1e3 * dt:.2f} ms" if self.debug >= 2 else ""), file=sys.stderr)
        if not finite:
            self._ready = None  # the culprit's search fills the inputs again
            raise self._non_finite(ub, out, res, partial(res.set_inputs, st, self.sched.cpu))
        if self._kept_logits is not None and ub.n_outputs:
            self._kept_logits.append(np.array(self.sched.get_tensor(res.logits)[:ub.n_real]))
        if self._kept_logprobs is not None and ub.n_outputs:
            self._kept_logprobs.append(self._logprobs(res, out[:ub.n_real]))
        return out[:ub.n_real] if ub.n_pad else out

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

    def _ready_next(self, st: UBatchState, res: GraphResult) -> ReadyStep | None:
        """The next step of st's one token's sequence, its inputs filled (ready_step.py); None where the host
        does not wait for a device (logits made on the CPU, whose buffer the inputs share: they are read after
        this) or the step cannot be foretold: a window's cache, no graph reuse, no free cell, another graph."""
        if res.logits.root.buffer.backend is self.sched.cpu:
            return None
        if not self.graph_reuse or self.kv_swa is not None or self.kv.window is not None:
            return None
        cells = self.kv.find_slot(1, st.ub.seq)
        if cells is None:
            return None
        ub = UBatch(st.ub.tokens, st.ub.pos + 1, st.ub.seq, st.ub.out_rows, 0)
        with self.kv.trial(cells, ub.pos, ub.seq):
            p = GraphParams(1, 1, self.kv.n_kv(), greedy=res.params.greedy)
            if res.reuse_blocker(p, self.kv_version, self.sched.generation) is not None:
                return None
            res.set_inputs(UBatchState(ub, cells, self.kv), self.sched.cpu)
        return ReadyStep(res, p, ub, cells, res.input_array("inp_tokens", self.sched.cpu), self._stamp())

    def _stamp(self) -> tuple[int, int]:
        """What a readied step's inputs were filled against: the cells' changes, the compute buffers' use."""
        return self.kv.changes, self.sched.activity

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

    def _graph_for(self, p: GraphParams) -> GraphResult:
        """A kept graph that can serve p, else a newly built and planned one (kept in turn)."""
        if self.graph_reuse:
            res, why = self.graphs.take(p, self.kv_version, self.sched.generation)
            if res is not None:
                self._reused(p, res)
                return res
        else:
            why = "first graph" if self.stats.graphs_built == 0 else "graph reuse disabled"
        t0 = time.perf_counter()
        res = self.build(p)
        t1 = time.perf_counter()
        self.sched.alloc(res.sg)
        t2 = time.perf_counter()
        self.stats.graphs_built += 1
        self.stats.build_s += t1 - t0
        self.stats.plan_s += t2 - t1
        if self.graph_reuse:
            self.graphs.keep(res)
        else:
            self.graphs.last = res
        self._log(False, f"rebuilt: {why}", p, res, (t1 - t0, t2 - t1))
        return res

    @property
    def result(self) -> GraphResult | None:
        """The graph the last micro-batch ran."""
        return self.graphs.last

    def _reused(self, p: GraphParams, res: GraphResult) -> None:
        self.stats.graphs_reused += 1
        self._log(True, "reused", p, res, (0.0, 0.0))

    def _log(self, reused: bool, what: str, p: GraphParams, res: GraphResult,
             times: tuple[float, float]) -> None:
        """Record the reuse decision; with GGRUN_GRAPH_DEBUG, keep its line for _decode_ubatch to print."""
        self.stats.reuse_log.append((reused, what))
        if not self.debug:
            return
        swa = f", n_kv_swa {p.n_kv_swa}" if p.n_kv_swa else ""
        line = f"graph: {what} (n_tokens {p.n_tokens}, n_outputs {p.n_outputs}, n_kv {p.n_kv}{swa})"
        if self.debug >= 2:
            sizes = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.sched.buffer_sizes().items())
            line += (f" nodes {len(res.sg.graph.nodes)} splits {len(res.sg.splits)} buffers [{sizes}]"
                     f" build {1e3 * times[0]:.2f} ms plan {1e3 * times[1]:.2f} ms")
        self._debug_line = line

    def _k_shift_graph(self, cache: KVCache):
        """The graph that re-rotates a cache's keys by their cells' shifts, and its shift input."""
        arch, hp = self.model.arch, self.model.hp
        build = build_k_shift_blocks if cache.type_k.is_quantized else build_k_shift
        return build(hp, cache, arch.rope_mode, lambda il: arch.rope_freq_base(hp, il))

    def _apply_k_shift(self, cache: KVCache) -> None:
        """Re-rotate cached keys whose positions moved (seq_add), then clear the shift. The kept
        decode graph stays: seq_add bumped the cache's version, so it is rebuilt (and says why)."""
        graph, inp = self._k_shift_graph(cache)
        sg = self.sched.schedule(graph)
        self.sched.alloc(sg)
        self.sched.cpu.array(inp.tensor)[...] = cache.shift
        self.sched.compute(sg)
        cache.shift[:] = 0
        cache.has_shift = False

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
