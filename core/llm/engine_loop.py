"""A request-level engine over one session: requests are submitted from any thread, wait in a bounded
queue, are decoded together by one loop in its own thread, and report each token as an event.

This is llama-server's slot loop on ggrun's batched decoder (the one `ggrun parallel` drives,
core/llm/parallel.py): n slots, one KV sequence each, every step one batch holding the next token of each
generating slot and the prompt tokens of newly started ones (within n_batch), each row's next token drawn
in the graph (Session.decode_sampled with a BatchedSampler slot per slot, or the argmax when every row is
greedy). The context is shared out as llama-server does: each slot may hold n_ctx / n_slots cells, so the
cache never runs out while every slot is busy. Requests that arrive together start together: the front end
opens an Arrival for each request it is still reading and checking (the HTTP layer turns a body into tokens
in its one thread, some 0.3-0.6 ms each on a 2-core CPU, so a burst of 16 reaches `submit` over ~10 ms), and
an idle loop that has admitted the first waits for the open ones (at most `gather_s`) before its first step.
Without that the burst's first prompt went alone into a step and the rest, already inside the server, waited
for that step to end (llama-server, reading bodies in many C++ threads, has no such spread to bridge). With no
other request arriving (one client) nothing waits. Without continuous batching (-nocb, llama-server's
--no-cont-batching) a step that has generating slots takes no prompt tokens: a new request's prompt waits
until every slot in flight has finished, then the waiting prompts go in together.

A slot keeps its tokens' cells after its request ends; the next request whose prompt starts with them
(cache_prompt) decodes only the rest. A request also takes the cells of a longer prefix that another slot
holds, busy or not (seq_cp: shared cells, as vLLM's prefix caching), so clients that send the same system
prompt read it once. A cancelled request (a client that went away) frees its slot before
the next step. Text is made incrementally (detok.IncrementalText): bytes of a character split across
tokens wait for the token that completes it, and characters that could begin a stop string wait until it
is clear they do not. A fault in a step (non-finite logits, a kernel's error) ends the requests in that
step with an error; the loop goes on.

Rows that ask for log-probabilities or that a constraint masks (structured output) bring their logits
back: the first get `logprobs.row_logprobs`, the second are drawn on the host from their masked logits by
their own seeded sampler (sampling.Sampler, the batched sampler's reference).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from ggrun.core.llm.batch import Batch
from ggrun.core.llm.batched_sampler import BatchedSampler
from ggrun.core.llm.detok import IncrementalText
from ggrun.core.llm.generate import common_prefix
from ggrun.core.llm.logprobs import TokenLogprob, row_logprobs
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session

FINISH_STOP = "stop"  # an end-of-generation token, a stop string, or a grammar that is complete
FINISH_LENGTH = "length"  # n_predict tokens, or the slot's share of the context is full
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"
GATHER_S = 0.05  # the longest an idle loop holds its first step for requests still arriving (Arrival)
MASKED = np.float32(-1e30)  # a masked token's logit: finite, so the sampler's finite check passes, never drawn


class Constraint(Protocol):
    """What structured output enforces on one request: the tokens allowed next, told each token drawn."""

    def allowed(self) -> np.ndarray:
        """A bool mask over the vocabulary: the tokens that may come next."""

    def accept(self, token: int) -> None:
        """The token drawn (one the mask allowed)."""

    @property
    def done(self) -> bool:
        """Whether nothing more may follow (the grammar is complete and allows no further token)."""


class QueueFull(Exception):
    """Every slot is busy and the wait queue holds its bound already."""


@dataclass
class Request:
    """One generation: a prompt's tokens and how to continue it."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1  # most tokens to generate; -1: until the slot's share of the context is full
    stops: tuple[str, ...] = ()
    ignore_eos: bool = False
    n_probs: int = 0  # the most likely tokens to report beside each drawn one
    logprobs: bool = False  # report each drawn token's log-probability
    cache_prompt: bool = True  # start from a slot that holds a prefix of the prompt
    constraint: Constraint | None = None
    special: bool = False  # render control tokens' text


@dataclass
class TokenEvent:
    """A token drawn for a request, with the text it releases (possibly empty)."""

    token: int
    text: str
    logprob: TokenLogprob | None = None


@dataclass
class DoneEvent:
    """A request ended: why, its whole text and its counts and times (llama-server's timings)."""

    finish_reason: str
    text: str
    n_prompt: int
    n_cached: int  # prompt tokens whose cells a slot held already
    n_predicted: int
    prompt_ms: float
    predicted_ms: float
    stop_word: str = ""
    error: str = ""
    slot: int = -1


Event = TokenEvent | DoneEvent


@dataclass
class Handle:
    """A submitted request: its id, where its events go, and whether it was cancelled."""

    id: int
    request: Request
    on_event: Callable[[Event], None]
    t_submit: float
    cancelled: bool = False


class Arrival:
    """A request the front end is still reading and checking, from the loop's view: while it is open, an idle
    loop that has a request already holds its first step for it (EngineLoop.arrival). Closed by the submit it
    leads to, or on leaving its `with` (a request refused before it was submitted); closing twice is nothing."""

    def __init__(self, loop: "EngineLoop") -> None:
        """Counted open in `loop` (made by EngineLoop.arrival)."""
        self._loop = loop
        self.open = True

    def close(self) -> None:
        """No longer arriving: submitted, or refused."""
        self._loop._arrived(self)

    def __enter__(self) -> "Arrival":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class EngineMetrics:
    """Counters as llama-server's /metrics reports them."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0
    n_busy_slots: int = 0  # busy slots summed over decodes
    requests_done: int = 0


@dataclass
class _Slot:
    """One slot: its sequence's cached tokens, the request it serves and that request's progress."""
    id: int
    handle: Handle | None = None
    cached: list[int] = field(default_factory=list)  # tokens whose cells this slot's sequence holds, by position
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet decoded
    response: list[int] = field(default_factory=list)
    next_token: int = -1
    text: IncrementalText | None = None
    sent: int = 0  # characters of text already given out
    n_cached: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    host: Sampler | None = None  # draws a constrained row from its masked logits
    last_used: float = 0.0

    @property
    def busy(self) -> bool:
        """Whether a request holds the slot."""
        return self.handle is not None


class EngineLoop:
    """n_slots slots over `session` (made with n_seq_max >= n_slots), served by one thread."""

    def __init__(self, session: Session, n_slots: int, n_batch: int = 2048, max_queue: int = 64,
                 cont_batching: bool = True, gather_s: float = GATHER_S) -> None:
        """slot_ctx: each slot's share of the context, n_ctx / n_slots; cont_batching False: prompts join only
        a step with no generating slot (llama-server's -nocb); gather_s: the longest an idle loop waits for
        requests still arriving before its first step."""
        self.s = session
        self.n_batch = n_batch
        self.cont_batching = cont_batching
        self.max_queue = max_queue
        self.slot_ctx = session.n_ctx // n_slots
        self.slots = [_Slot(i) for i in range(n_slots)]
        self.sampler = BatchedSampler([SamplingParams(temp=0.0)] * n_slots, session.n_ctx)
        self.tok = session.model.tokenizer
        self.eog = np.fromiter(self.tok.eog_ids, dtype=np.int64)
        self.metrics = EngineMetrics()
        self._queue: deque[Handle] = deque()
        self._cv = threading.Condition()
        self._next_id = 0
        self._arriving = 0  # open Arrivals
        self.gather_s = gather_s
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the API other threads call ------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a thread of its own (or call `run` in a thread made for it)."""
        self._thread = threading.Thread(target=self.run, name="ggrun-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop (requests still queued or running get no more events)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def arrival(self) -> Arrival:
        """Open an Arrival for a request the caller is reading and will submit (or refuse): an idle loop holds
        its first step for it, so that requests arriving together start in one batch."""
        with self._cv:
            self._arriving += 1
        return Arrival(self)

    def _arrived(self, arrival: Arrival) -> None:
        """Close an arrival (once), and wake the loop that may be waiting for it."""
        with self._cv:
            if arrival.open:
                arrival.open = False
                self._arriving -= 1
                self._cv.notify()

    def submit(self, request: Request, on_event: Callable[[Event], None], arrival: Arrival | None = None) -> Handle:
        """Queue a request; its events go to on_event, called on the engine's thread. QueueFull past the bound.
        `arrival`: the Arrival this request was read under, closed here (queued or refused)."""
        with self._cv:
            if arrival is not None:
                self._arrived(arrival)
            if len(self._queue) >= self.max_queue + sum(not s.busy for s in self.slots):
                raise QueueFull(f"{len(self._queue)} requests wait for a slot already (the bound)")
            self._next_id += 1
            h = Handle(self._next_id, request, on_event, time.perf_counter())
            self._queue.append(h)
            self._cv.notify()
        return h

    def cancel(self, handle: Handle) -> None:
        """Stop a request; its slot is free before the next step (a queued one never starts)."""
        with self._cv:
            handle.cancelled = True
            self._cv.notify()

    @property
    def n_deferred(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    @property
    def n_processing(self) -> int:
        """Slots serving a request."""
        return sum(s.busy for s in self.slots)

    def slot_states(self) -> list[dict]:
        """Each slot as llama-server's /slots lists it (a snapshot; read without stopping the loop)."""
        out = []
        for s in self.slots:
            h = s.handle
            out.append({"id": s.id, "id_task": h.id if h else -1, "n_ctx": self.slot_ctx, "is_processing": h is not None,
                        "n_cached": len(s.cached), "n_decoded": len(s.response) if h else 0,
                        "params": _params_dict(h.request) if h else {}})
        return out

    # ---- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        """The loop: admit queued requests into free slots, step, until `stop`. The numba kernels' thread count
        is per thread: the caller's thread should have set it (core.backends.cpu.set_threads)."""
        while True:
            with self._cv:
                while not self._stopping and not self._queue and not any(s.busy for s in self.slots):
                    self._cv.wait()
                if self._stopping:
                    return
                idle = not any(s.busy for s in self.slots)
                self._drop_cancelled()
                self._admit()
                if idle:
                    self._gather()
            if any(s.busy for s in self.slots):
                self._step_safely()

    def _gather(self) -> None:
        """Before an idle loop's first step (the lock held): while requests are still arriving and a slot is free
        for them, wait for them (at most gather_s) and admit each as it is queued."""
        deadline = time.perf_counter() + self.gather_s
        while self._arriving and not self._stopping and any(not s.busy for s in self.slots):
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._cv.wait(left)
            self._drop_cancelled()
            self._admit()

    def _drop_cancelled(self) -> None:
        """Cancelled requests leave the queue; cancelled slots end (their cells stay for a later prefix)."""
        for h in [h for h in self._queue if h.cancelled]:
            self._queue.remove(h)
            h.on_event(DoneEvent(FINISH_CANCELLED, "", len(h.request.prompt), 0, 0, 0.0, 0.0))
        for s in self.slots:
            if s.busy and s.handle.cancelled:
                self._finish(s, FINISH_CANCELLED)

    def _admit(self) -> None:
        """Start queued requests, first come first served, each in the free slot that holds the longest
        prefix of its prompt (else the one unused longest)."""
        while self._queue:
            free = [s for s in self.slots if not s.busy]
            if not free:
                return
            h = self._queue.popleft()
            held = self._prefixes(h.request)
            self._start(max(free, key=lambda s: (held[s.id], -s.last_used)), h, held)

    def _prefixes(self, req: Request) -> list[int]:
        """How many of req's prompt tokens, from the start, each slot's cells hold (busy or not: between steps
        every cached token's cells are written); all 0 without cache_prompt."""
        if not req.cache_prompt:
            return [0] * len(self.slots)
        prompt = np.asarray(req.prompt)
        return [common_prefix(s.cached, prompt) if s.cached else 0 for s in self.slots]

    def _start(self, s: _Slot, h: Handle, held: list[int]) -> None:
        """Start a request in slot s: keep the cells of the prompt's prefix the slot holds, or take those of a
        longer prefix another slot holds (seq_cp: the cells are shared, no data moves; not in a session with a
        sliding-window cache, which frees cells behind a sequence's window that the sharer would need), and
        queue the rest. held: _prefixes of the request."""
        req = h.request
        keep = held[s.id]
        donor = max(self.slots, key=lambda o: held[o.id])
        if held[donor.id] > keep and self.s.kv_swa is None:
            keep = held[donor.id]
            self.s.seq_rm(s.id)
            self.s.seq_cp(donor.id, s.id, 0, keep)
        keep = min(keep, len(req.prompt) - 1)  # the last prompt token is decoded again for its logits
        self.s.seq_rm(s.id, keep, -1)
        s.handle, s.cached, s.pending = h, list(req.prompt[:keep]), list(req.prompt[keep:])
        s.response, s.next_token, s.sent, s.n_cached = [], -1, 0, keep
        s.t_start, s.t_first = time.perf_counter(), 0.0
        s.text = IncrementalText(self.tok, req.stops, special=req.special)
        self.sampler.configure(s.id, req.sampling)
        self.sampler.accept(s.id, req.prompt)
        s.host = None
        if req.constraint is not None:
            s.host = Sampler(req.sampling, self.s.n_ctx)
            for t in req.prompt[-max(req.sampling.repeat_last_n, 0):]:
                s.host.accept(t)
        if req.n_predict == 0:
            self._finish(s, FINISH_LENGTH)

    def _step_safely(self) -> None:
        """One step; a fault ends the requests that were in it with an error, and the loop goes on."""
        try:
            self._step()
        except Exception as err:  # noqa: BLE001 - the loop must outlive any one batch
            msg = f"{type(err).__name__}: {err}"
            for s in self.slots:
                if s.busy:
                    self.s.seq_rm(s.id)
                    s.cached = []
                    self._finish(s, FINISH_ERROR, error=msg)

    def _step(self) -> None:
        """One decode: the next token of every generating slot, then prompt tokens within n_batch (without
        continuous batching, only when no slot is generating: llama-server's update_slots)."""
        gen = [s for s in self.slots if s.busy and not s.pending]
        rows = list(gen)
        n = len(gen)
        tokens = [s.next_token for s in gen]
        pos = [len(s.cached) for s in gen]
        seq = [s.id for s in gen]
        want = [True] * n
        for s in gen:
            s.cached.append(s.next_token)
        for s in self.slots:
            if not s.busy or not s.pending or n >= self.n_batch or (gen and not self.cont_batching):
                continue
            chunk, s.pending = s.pending[:self.n_batch - n], s.pending[self.n_batch - n:]
            tokens += chunk
            pos += range(len(s.cached), len(s.cached) + len(chunk))
            seq += [s.id] * len(chunk)
            want += [False] * (len(chunk) - 1) + [not s.pending]
            s.cached += chunk
            n += len(chunk)
            if not s.pending:
                rows.append(s)
        batch = Batch(np.asarray(tokens, dtype=np.int32), np.asarray(pos, dtype=np.int32),
                      np.asarray(seq, dtype=np.int32), np.asarray(want, dtype=bool))
        t0 = time.perf_counter()
        ids, lps = self._draw(batch, rows)
        self.metrics.n_decode += 1
        self.metrics.n_busy_slots += sum(s.busy for s in self.slots)
        dt = time.perf_counter() - t0
        n_gen = len(gen)
        self.metrics.predicted_seconds += dt * n_gen / max(n, 1)
        self.metrics.prompt_seconds += dt * (n - n_gen) / max(n, 1)
        self.metrics.prompt_tokens += n - n_gen
        if not rows:
            return
        slots = np.fromiter((s.id for s in rows), dtype=np.int64, count=len(rows))
        self.sampler.accept_rows(slots, ids)
        ended = np.isin(ids, self.eog).tolist()
        for s, tok, eog, lp in zip(rows, ids.tolist(), ended, lps):
            self._advance(s, tok, eog, lp)

    def _draw(self, batch: Batch, rows: list[_Slot]) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """Decode the batch; each row's next token and, where it asked, its log-probabilities."""
        none: list[TokenLogprob | None] = [None] * len(rows)
        reqs = [s.handle.request for s in rows]
        with_logits = any(r.logprobs or r.n_probs or r.constraint is not None for r in reqs)
        greedy = all(r.sampling.temp <= 0 and not r.sampling.logit_bias and not r.sampling.penalties_on for r in reqs)
        slots = np.fromiter((s.id for s in rows), dtype=np.int64, count=len(rows))
        if not with_logits and greedy:
            return self.s.decode_greedy(batch), none
        if not with_logits:
            return self.s.decode_sampled(batch, self.sampler.rows(slots)), none
        ids, logits = self.s.decode_sampled(batch, self.sampler.rows(slots), with_logits=True)
        ids = np.array(ids, dtype=np.int32)
        lps = list(none)
        for i, (s, r) in enumerate(zip(rows, reqs)):
            if r.constraint is not None:
                ids[i] = self._constrained(s, r.constraint, logits[i])
            if r.logprobs or r.n_probs:
                lps[i] = row_logprobs(logits[i], int(ids[i]), r.n_probs)
        return ids, lps

    def _constrained(self, s: _Slot, c: Constraint, logits: np.ndarray) -> int:
        """The row's token drawn on the host from its logits with every token the constraint forbids masked."""
        masked = np.where(c.allowed(), logits, MASKED).astype(np.float32)
        tok = s.host.sample(masked)
        s.host.accept(tok)
        return tok

    def _advance(self, s: _Slot, tok: int, eog: bool, lp: TokenLogprob | None) -> None:
        """Take a slot's next token: end at EOG, a stop string, n_predict, the slot's context or a complete
        grammar; else give out the text that is sure."""
        req = s.handle.request
        if not s.t_first:
            s.t_first = time.perf_counter()
        if req.constraint is not None:
            req.constraint.accept(tok)
        if eog and not req.ignore_eos:
            self._finish(s, FINISH_STOP)
            return
        s.response.append(tok)
        s.text.add(tok)
        self.metrics.tokens_predicted += 1
        why = ""
        if s.text.stop_at >= 0:
            why = FINISH_STOP
        elif req.constraint is not None and req.constraint.done:
            why = FINISH_STOP
        elif 0 <= req.n_predict <= len(s.response) or len(s.cached) + 1 >= self.slot_ctx:
            why = FINISH_LENGTH
        if why:
            s.handle.on_event(TokenEvent(tok, self._release(s, final=True), lp))
            self._finish(s, why)
            return
        s.handle.on_event(TokenEvent(tok, self._release(s, final=False), lp))
        s.next_token = tok

    def _release(self, s: _Slot, final: bool) -> str:
        """The text not given out yet that is sure: up to a stop string found, all of it at the end, else
        all but the characters that could begin a stop string."""
        t = s.text
        if t.stop_at >= 0:
            end = t.stop_at
        elif final:
            out = t.result()[s.sent:]
            s.sent += len(out)
            return out
        else:
            end = t.n_chars - t.partial_stop()
        if end <= s.sent:
            return ""
        out = t.text[s.sent:end]
        s.sent = end
        return out

    def _finish(self, s: _Slot, why: str, error: str = "") -> None:
        """End the slot's request with `why`; its cells stay for a later prompt with the same prefix."""
        h = s.handle
        now = time.perf_counter()
        first = s.t_first or now
        done = DoneEvent(why, s.text.result() if s.text else "", len(h.request.prompt), s.n_cached, len(s.response),
                         1e3 * (first - s.t_start), 1e3 * (now - first), s.text.stop if s.text else "", error, s.id)
        s.handle, s.pending, s.host, s.last_used = None, [], None, now
        self.metrics.requests_done += 1
        h.on_event(done)


def _params_dict(r: Request) -> dict:
    """A request's settings as /slots shows them."""
    p = r.sampling
    return {"n_predict": r.n_predict, "temperature": p.temp, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "seed": p.seed, "stop": list(r.stops), "n_probs": r.n_probs, "cache_prompt": r.cache_prompt}
