"""Continuous batching of many sequences over one KV cache (llama-parallel's job).

A shared system prompt is evaluated once as sequence 0; each client's sequence shares
those cells (seq_cp, no re-evaluation). Every step decodes one batch holding one token of
each generating client and the prompt tokens of newly started ones. A finished sequence
frees its cells and the client starts the next one at once (without continuous batching, new
sequences start only when every client is idle). A response ends at an end-of-generation token, at
n_predict tokens, or where its text shows `stop_text` (llama-parallel's "User:", the next turn; the
text is cut there); without n_predict, at the end of its share of the cache, which its result says
(stop_reason) while the others go on. A sequence that cannot get cells yet waits; one that could never
fit is reported and skipped. An interrupted session (Ctrl-C) ends the run with the sequences already
finished and the totals so far.

Prompts that begin alike share cells (prefix sharing, as vLLM's automatic prefix caching): a sequence that
starts while another holds the cells of a prefix of its prompt takes those cells (seq_cp, no data moves) and
decodes only the rest of its prompt. Requests that each carry the same system prompt (llama-parallel's
default) then read it once, not once per sequence, and hold its cells once. Where another sequence is still
reading a longer prefix than any held, of PREFIX_WAIT tokens or more, the next sequence waits until it is
read instead of reading the same tokens beside it, and lets sequences behind it in the queue start meanwhile. A
finished sequence's prompt cells stay held by its idle client (llama-server's prompt cache, a client's own), so
that a later prompt that begins alike, on that client or another, reads only what differs, as with one client
(-np 1); held cells give way whenever a sequence needs cells. The K and V of a shared cell are those the sequence
would have computed at that position (with `--numerics f32` the same bits). `--no-prefix-share` reads every prompt
whole, as llama-parallel does. With sliding-window layers a sequence lends its cells only while it has left
none of them in the window's cache (until it passes the window's length): a later sequence would miss those.

Long prompts are read in chunks (chunked prefill, as llama.cpp's server and vLLM do): a step holds every
generating client's next token and prompt tokens up to a budget of `chunk` tokens in all (by default one
micro-batch, n_ubatch), so a client reading a long prompt holds the others up by one chunk per step, not by
its whole prompt; the prompt goes on in the next steps beside their tokens. A step always takes at least
one prompt token while some prompt waits, so prompts move even when the generating clients fill the budget.

A step's host work does not grow with per-token Python: the generating clients' tokens, positions and
sequence ids are rows of arrays, every row's next token is drawn in the graph (Session.decode_sampled,
one BatchedSampler slot per client; the argmax where every client samples greedily), and the stop text
is looked for in each response's new text only (detok.IncrementalText).

The host works while the device computes: a step's token ids are taken (each sequence's next token, or its end at
an end-of-generation token or its limit), the next step is launched with them (Session.decode_begin), and only
then is the step settled: its texts grown, its stop texts looked for, its ended sequences reported and their
cells freed. A sequence that ends by its text so has a row in the step launched meanwhile: that row's token is
dropped and its draw given back to its client's stream (BatchedSampler.unread), so every client draws as if each
step had waited for the one before. On the H200 the host's share of a step of 64 sequences was ~1 ms of ~4.5.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggrun.core.errors import Interrupted
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.batched_sampler import BatchedSampler, SamplingRows
from ggrun.core.llm.detok import IncrementalText
from ggrun.core.llm.generate import PromptTable, eval_prompt
from ggrun.core.llm.sampling import SamplingParams
from ggrun.core.llm.session import Session

SYSTEM_SEQ = 0
STOP_EOG = "end of generation"
STOP_LIMIT = "n_predict reached"
STOP_TEXT = "stop text"
STOP_CACHE = "its share of the KV cache is used up"
PREFIX_WAIT = 64  # a prefix in flight this long or longer is worth waiting for
# jobs a round finds waiting for a prefix before it looks no further: each costs a look at every client's prompt
# (_prefix_of), and a long prefix in flight would otherwise have every queued job looked at each step
PASS_WAITING = 16
REHEARSAL_TOKENS = 8  # tokens each sequence of ParallelRunner.rehearse generates at most


@dataclass
class SequenceResult:
    client: int
    seq: int
    input: str
    prompt_tokens: list[int]
    response_tokens: list[int]
    response: str
    seconds: float
    skipped: str = ""  # why the sequence was not run, when it could never fit
    stop_reason: str = ""  # STOP_* above

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def n_response(self) -> int:
        return len(self.response_tokens)


@dataclass
class ParallelSummary:
    """Totals as llama-parallel reports them: tokens of the clients' prompts (a shared system prompt is
    counted apart) and responses, each speed over the whole run's time."""

    n_prompt: int = 0  # prompt tokens of finished sequences
    n_gen: int = 0  # response tokens of finished sequences
    total_s: float = 0.0
    cache_misses: int = 0  # times a ready sequence had to wait for free KV cells
    n_prompt_shared: int = 0  # prompt tokens taken from another sequence's cells (prefix sharing), not decoded
    graphs_reused: int = 0
    n_system: int = 0
    n_done: int = 0  # sequences finished or skipped
    n_sequences: int = 0  # sequences asked for
    interrupted: bool = False

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.total_s if self.total_s else 0.0

    @property
    def gen_tps(self) -> float:
        return self.n_gen / self.total_s if self.total_s else 0.0

    @property
    def total_tps(self) -> float:
        return (self.n_prompt + self.n_gen) / self.total_s if self.total_s else 0.0


@dataclass
class _Client:
    id: int
    seq_id: int
    job: int = -1  # index of the sequence being served, -1 when idle
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet decoded
    prompt: list[int] = field(default_factory=list)
    response: list[int] = field(default_factory=list)
    pos: int = 0
    next_token: int = -1  # sampled, to be decoded in the next step
    limit: int = 0  # response tokens this sequence may generate
    t0: float = 0.0
    text: IncrementalText | None = None  # the response's text, for the stop text
    serial: int = 0  # counts the sequences the client started and ended: a step's row is the sequence's it was
    ending: str = ""  # the stop reason once its last token is known (EOG, the limit), until it is settled
    held: int = 0  # idle: tokens of its last prompt whose cells it still holds, for later prompts to share

    def cells_still_needed(self) -> int:
        """Cells this sequence may still take: its undecoded prompt and the response tokens still to be
        decoded (the last of `limit` tokens is sampled, never decoded; k sampled so far leave limit - k)."""
        return len(self.pending) + self.limit - max(len(self.response), 1)


@dataclass
class _Step:
    """A launched step: the clients whose next tokens it draws (each with its serial then and its sampling
    row), what waits for those tokens, and once taken, the tokens each client's sequence takes."""

    rows: list[_Client]
    serials: list[int]
    slots: np.ndarray
    sampling: SamplingRows | None
    wait: Callable[[], tuple[np.ndarray, np.ndarray | None]]  # (ids, logits when kept)
    decode_only: bool = False  # one token of each of its rows' sequences, no prompt tokens
    taken: list[tuple[_Client, int, bool]] = field(default_factory=list)  # (client, token, end of generation)


class ParallelRunner:
    """Serves `prompts` with n_clients concurrent sequences on one session. n_predict 0 or less lets a
    response run until it ends by itself, within an equal share of the cache per client."""

    def __init__(self, session: Session, n_clients: int, n_predict: int, sampling: SamplingParams,
                 n_batch: int, ignore_eos: bool = False, stop_text: str | None = None,
                 cont_batching: bool = True, keep_logits: bool = False, chunk: int | None = None,
                 prefix_share: bool = True) -> None:
        self.s = session
        self.n_predict = n_predict
        self.n_batch = n_batch
        self.chunk = step_budget(chunk, n_batch, session.n_ubatch)
        self.ignore_eos = ignore_eos
        self.stop_text = stop_text
        self.cont_batching = cont_batching
        self.prefix_share = prefix_share
        # a sliding-window cache frees a sequence's cells behind its window, which a later sequence sharing its
        # prefix would still need: only a sequence that has freed none (_lends) lends its prefix
        self.window = session.kv_swa.window if session.kv_swa is not None else None
        self.clients = [_Client(i, i + 1) for i in range(n_clients)]
        self.prompts = PromptTable(n_clients)  # each client's last prompt, for the prefixes later prompts share
        self.sampler = BatchedSampler([_seeded(sampling, i) for i in range(n_clients)], session.n_ctx)
        self.greedy = sampling.temp <= 0 and not sampling.logit_bias and not sampling.penalties_on
        self.eog = np.fromiter(session.model.tokenizer.eog_ids, dtype=np.int64)
        # with keep_logits, every row of logits a job's tokens were drawn from (they come back to the host)
        self.logits: dict[int, list[np.ndarray]] | None = {} if keep_logits else None
        self.n_system = 0
        self.system: list[int] = []
        self.summary = ParallelSummary()

    def warm_up(self, n_system: int = 0) -> None:
        """Untimed, before run: a system prompt of n_system placeholder tokens read as run reads its own, then one
        token of every client decoded twice (sampled as the run samples, from streams of the warm-up's own), the
        cache cleared after each. As llama.cpp's tools warm up with a decode and bench --batched warms each row up
        twice, the kernels of the run's decode steps are loaded, and the graphs of the system prompt's micro-batches
        (their shapes are its length's) and of a step of every client are built, planned and (on a GPU) captured,
        before the run's clock starts: a graph built in the run cost it 30-90 ms of the H200's host. With prefix
        sharing the clients' sequences share a first cell (client 0's, seq_cp), as the run's share prompts' cells:
        their steps' graph is the one that reads shared cells once for all (GraphParams.shared). The decodes are
        skipped where the cache cannot hold three tokens of every client."""
        if 0 < n_system < self.s.n_ctx:
            self.s.clear()
            eval_prompt(self.s, [0] * n_system, self.n_batch, seq=SYSTEM_SEQ)
            self.s.clear()
        n = len(self.clients)
        if self.s.n_ctx < 3 * n:
            return
        seqs = np.fromiter((c.seq_id for c in self.clients), dtype=np.int32, count=n)
        sampler = BatchedSampler(self.sampler.settings, self.s.n_ctx)
        self.s.clear()
        first = 0
        if self.prefix_share and n > 1:
            self._warm_step(Batch(np.zeros(1, np.int32), np.zeros(1, np.int32), seqs[:1], np.ones(1, bool)), sampler)
            for c in self.clients[1:]:
                self.s.seq_cp(self.clients[0].seq_id, c.seq_id)
            first = 1
        for pos in range(first, first + 2):
            self._warm_step(Batch(np.zeros(n, np.int32), np.full(n, pos, np.int32), seqs, np.ones(n, bool)), sampler)
        self.s.clear()

    def rehearse(self, system_prompt: list[int], prompts: list[tuple[str, list[int]]]) -> None:
        """Untimed, before run: the run's opening served once and forgotten, as bench --batched warms each row up
        with its own prompts. The system prompt, then the first prompt of every client, served as run serves them
        but with at most REHEARSAL_TOKENS tokens generated each, from streams of the rehearsal's own; then the
        cache cleared and every client, its sampler rows and the totals as before. Clients joining at once read
        their prompts in mixed steps whose shapes (tokens, outputs, cells attended) only such an opening makes;
        their graphs, built inside the run, cost an H100's host ~40 ms apiece (4 of a 2.2 s run of 64 clients).
        Served twice, as bench --batched's rows are: the second time captures them. The same opening later finds
        them kept (the cache's cells are laid out as in the rehearsal). Only in a session of many sequences off
        the CPU (Session.seq_words): on the CPU a graph costs milliseconds, and the rehearsal's prompts more."""
        if not self.s.seq_words:
            return
        n_predict, sampler, logits = self.n_predict, self.sampler, self.logits
        self.n_predict = min(n_predict, REHEARSAL_TOKENS) if n_predict > 0 else REHEARSAL_TOKENS
        self.logits = None if logits is None else {}
        try:
            for _ in range(2):  # a graph runs eagerly first and is captured the second time (cuda/graphs.py)
                self.sampler = BatchedSampler(sampler.settings, self.s.n_ctx)
                self._forget()
                self._serve(system_prompt, prompts[:len(self.clients)], lambda r: None)
        finally:
            self.n_predict, self.sampler, self.logits = n_predict, sampler, logits
            self._forget()

    def _forget(self) -> None:
        """Every client idle and holding nothing, the totals zero, the cache empty."""
        self.clients = [_Client(c.id, c.seq_id) for c in self.clients]
        self.prompts = PromptTable(len(self.clients))
        self.summary = ParallelSummary()
        self.s.clear()

    def _warm_step(self, batch: Batch, sampler: BatchedSampler) -> None:
        """A warm-up decode, sampled as the run samples (or greedily), from the warm-up's streams."""
        if self.greedy:
            self.s.decode_greedy(batch)
        else:
            self.s.decode_sampled(batch, sampler.rows(np.arange(len(batch))))

    def run(self, system_prompt: list[int], prompts: list[tuple[str, list[int]]],
            on_done: Callable[[SequenceResult], None]) -> ParallelSummary:
        """Evaluate the system prompt once, then serve every prompt; returns the totals."""
        t_start = time.perf_counter()
        reused_before = self.s.stats.graphs_reused
        self.summary.n_sequences = len(prompts)
        try:
            self._serve(system_prompt, prompts, on_done)
        except Interrupted:
            self.summary.interrupted = True
        self.summary.total_s = time.perf_counter() - t_start
        self.summary.graphs_reused = self.s.stats.graphs_reused - reused_before
        return self.summary

    def _serve(self, system_prompt: list[int], prompts: list[tuple[str, list[int]]],
               on_done: Callable[[SequenceResult], None]) -> None:
        self._system(system_prompt)
        queue = list(range(len(prompts)))

        def done(r: SequenceResult) -> None:
            self.summary.n_done += 1
            on_done(r)

        step: _Step | None = None  # launched last; its tokens are taken before the next step is launched
        while self.summary.n_done < len(prompts):
            may_start = self.cont_batching or not any(c.job >= 0 for c in self.clients)
            waiting: set[int] = set()  # jobs found waiting for a prefix another sequence reads, this round
            for c in self.clients:
                if c.job < 0 and queue and may_start and self._start_next(c, queue, prompts, waiting, done) == "full":
                    break  # first come, first served: the first that cannot start waits for cells, and all behind it
            if step is None and not any(c.job >= 0 for c in self.clients):
                if queue:
                    continue  # every waiting sequence was skipped this round; try the rest
                break
            launched = None
            if step is not None:
                launched = self._follow(step, bool(queue) and any(c.job < 0 for c in self.clients))
                self._take(step)
            if launched is None and any(_works(c) for c in self.clients):
                launched = self._step(prompts)
            if step is not None:
                for r in self._settle(step, prompts):
                    done(r)
            step = launched
        if step is not None:  # rows of sequences that ended by their text meanwhile: nothing to take
            self._take(step)
        self._drop_held()

    def _system(self, tokens: list[int]) -> None:
        self.s.clear()
        self.n_system = len(tokens)
        self.system = list(tokens)
        self.summary.n_system = len(tokens)
        if tokens:
            eval_prompt(self.s, tokens, self.n_batch, seq=SYSTEM_SEQ)

    def _free_cells(self) -> int:
        return self.s.kv.n_free() - sum(c.cells_still_needed() for c in self.clients if c.job >= 0)

    def _start_next(self, c: _Client, queue: list[int], prompts, waiting: set[int],
                    done: Callable[[SequenceResult], None]) -> str:
        """Start the first queued job that can start on idle client c ('started'), or report the first that never
        can ('skip'), in the queue's order: first come, first served, but a job that waits for a prefix another
        sequence is reading (`waiting`, found so this round) lets those behind it pass, as it starts a step later
        whatever they do; 'full' where the first that cannot start waits for cells, which none behind it may take;
        'none' past PASS_WAITING jobs waiting for a prefix. Held up by each prefix in turn, 64 clients joining a run took 9 steps of as many shapes, each a graph
        built for one use (~66 ms of the H200's host)."""
        for i, job in enumerate(queue):
            if job in waiting:
                continue
            if len(waiting) >= PASS_WAITING:
                break
            verdict = self._try_start(c, job, prompts)
            if verdict == "prefix":
                waiting.add(job)
                continue
            if verdict == "skip":
                done(self._skipped(c, queue.pop(i), prompts))
            elif verdict == "started":
                queue.pop(i)
            return verdict
        return "none"

    def _try_start(self, c: _Client, job: int, prompts) -> str:
        """Start `job` on client c when the cache can hold its worst case ('started'); 'skip' if it never can,
        'prefix' while another sequence reads a prefix of its prompt, 'full' while the cache has too few cells."""
        tokens = prompts[job][1]
        need = self._cells_needed(tokens)
        if need > self.s.n_ctx - self.n_system or not tokens:
            return "skip"
        ids = np.asarray(tokens, dtype=np.int32)
        src, shared, in_flight = self._prefix_of(ids) if self.prefix_share else (None, 0, 0)
        if in_flight > shared and in_flight >= PREFIX_WAIT:
            return "prefix"  # another sequence is reading this prompt's beginning: share it once read
        free = self._free_cells()
        if need - shared > free and self._drop_held():  # held prefixes give way, then share anew
            src, shared, in_flight = self._prefix_of(ids) if self.prefix_share else (None, 0, 0)
            free = self._free_cells()
        if need - shared > free:
            self.summary.cache_misses += 1
            return "full"
        if src is c:  # the client's own last prompt: keep its shared part
            self.s.seq_rm(c.seq_id, self.n_system + shared)
        else:
            self.s.seq_rm(c.seq_id)
            if self.n_system:
                self.s.seq_cp(SYSTEM_SEQ, c.seq_id)
            if shared:
                self.s.seq_cp(src.seq_id, c.seq_id, self.n_system, self.n_system + shared)
        self.summary.n_prompt_shared += shared
        c.held = 0
        c.job, c.prompt, c.pending = job, list(tokens), list(tokens[shared:])
        self.prompts.set(c.id, ids)
        c.response, c.pos, c.next_token, c.ending = [], self.n_system + shared, -1, ""
        c.serial += 1
        c.limit = self._limit(tokens)
        c.t0 = time.perf_counter()
        c.text = IncrementalText(self.s.model.tokenizer, (self.stop_text,) if self.stop_text else ())
        # the repetition penalty sees this sequence's tokens only, as generating it alone would
        self.sampler.reset(c.id)
        self.sampler.accept(c.id, self.system + tokens)
        return "started"

    def _prefix_of(self, ids: np.ndarray) -> tuple[_Client | None, int, int]:
        """The client whose cells hold the longest prefix of prompt `ids` (None if none): a running one, or an
        idle one that still holds its last prompt's cells; that prefix's length; and the longest prefix any
        running client's prompt has in common with it, read or not. Never the whole prompt: its last token is
        decoded for the logits of the first response token."""
        src, best, in_flight = None, 0, 0
        common = np.minimum(self.prompts.common(ids), len(ids) - 1).tolist()
        for c, n in zip(self.clients, common):
            if c.job < 0 and not c.held:
                continue
            read = min(n, c.held if c.job < 0 else len(c.prompt) - len(c.pending))
            if read > best and self._lends(c):
                src, best = c, read
            if c.job >= 0:
                in_flight = max(in_flight, n)
        return src, best, in_flight

    def _drop_held(self) -> bool:
        """Free the cells idle clients hold for sharing; whether any were held."""
        dropped = False
        for c in self.clients:
            if c.job < 0 and c.held:
                self.s.seq_rm(c.seq_id)
                c.held, dropped = 0, True
        return dropped

    def _lends(self, c: _Client) -> bool:
        """Whether c's cells may be shared: always without a sliding window; with one, while c has left none of
        its cells in the window's cache (it leaves those up to position pos - 1 - window, and a sequence that
        copies c's cells afterwards would miss them)."""
        return self.window is None or c.pos <= self.window

    def _limit(self, tokens: list[int]) -> int:
        """Response tokens a sequence may generate: n_predict, or without one an equal share of the cells
        beside the system prompt, less its prompt."""
        if self.n_predict > 0:
            return self.n_predict
        return max(1, (self.s.n_ctx - self.n_system) // len(self.clients) - len(tokens))

    def _cells_needed(self, tokens: list[int]) -> int:
        """Cells a sequence takes beside the system prompt: its prompt and limit - 1 decoded tokens."""
        return len(tokens) + max(self._limit(tokens) - 1, 0)

    def _step(self, prompts) -> _Step:
        """Launch one decode: a token of every generating client, then prompt tokens (first come, first served) up
        to the step's budget (`chunk` tokens in all, at least one prompt token); every row that asks logits gets
        its next token drawn in the graph. The tokens are taken later (_take), so that the host settles the step
        before (_settle) while the device computes this one."""
        gen = [c for c in self.clients if c.job >= 0 and not c.pending and not c.ending]
        rows = list(gen)
        tokens = np.fromiter((c.next_token for c in gen), dtype=np.int32, count=len(gen))
        parts = [(tokens, *_next_positions(gen), np.ones(len(gen), dtype=bool))]
        n = len(gen)
        budget = max(self.chunk, n + 1)
        for c in self.clients:
            if c.job < 0 or not c.pending or n >= budget:
                continue
            chunk, c.pending = c.pending[:budget - n], c.pending[budget - n:]
            last = np.zeros(len(chunk), dtype=bool)
            last[-1] = not c.pending
            parts.append((np.asarray(chunk, dtype=np.int32), np.arange(c.pos, c.pos + len(chunk), dtype=np.int32),
                          np.full(len(chunk), c.seq_id, dtype=np.int32), last))
            c.pos += len(chunk)
            n += len(chunk)
            if not c.pending:
                rows.append(c)
        batch = Batch(*(np.concatenate(x) if len(parts) > 1 else x[0] for x in zip(*parts)))
        slots = np.fromiter((c.id for c in rows), dtype=np.int64, count=len(rows))
        sampling = None if self.greedy and self.logits is None else self.sampler.rows(slots)
        ahead = sum(len(c.pending) for c in self.clients if c.job >= 0)  # prompt tokens left for later steps
        return _Step(rows, [c.serial for c in rows], slots, sampling, self._begin(batch, sampling, ahead),
                     len(parts) == 1)

    def _follow(self, step: _Step, may_join: bool) -> _Step | None:
        """The next step, launched as soon as `step`'s token ids are back and before they are taken, where it is
        one token of each of step's sequences again: step decoded only, none of them has ended since nor reaches
        its limit with step's token, no prompt waits and no client is free to start one (`may_join`), and no
        penalty needs step's tokens in its window. Its positions and draws are made while the device computes
        step; its tokens are step's ids, which the session asks for last (decode_begin's `tokens`: its cells and
        sampling rows are written while the device still computes step). A row whose sequence ends at step's
        token (end of generation) is dropped as one ended by its text is. The host's work between two steps of 64
        sequences is then the token ids' write and the launch (~0.07 ms on an H100's host), not the tokens'
        taking and the next batch's making (~0.5 ms on the H200's Xeon)."""
        rows = step.rows
        if (not step.decode_only or may_join or self.logits is not None or self.sampler.keeps.any()
                or any(c.pending for c in self.clients)
                or not all(c.serial == n and not c.ending and len(c.response) + 2 <= c.limit
                           for c, n in zip(rows, step.serials))):
            return None
        pos, seq = _next_positions(rows)
        sampling = None if self.greedy else self.sampler.rows(step.slots)
        batch = Batch(np.zeros(len(rows), dtype=np.int32), pos, seq, np.ones(len(rows), dtype=bool))
        ids = self._begin(batch, sampling, tokens=lambda: step.wait()[0])
        return _Step(list(rows), list(step.serials), step.slots, sampling, ids, True)

    def _begin(self, batch: Batch, sampling: SamplingRows | None, ahead: int = 0,
               tokens: Callable[[], np.ndarray] | None = None) -> Callable[[], tuple[np.ndarray, np.ndarray | None]]:
        """Decode the batch, left computing where only token ids come back; what waits for (ids, logits kept).
        `ahead`: the prompt tokens later steps will read (Session.decode_begin): a long prompt's chunks then
        attend over the cells it will fill, and share one graph, where n_kv growing with each chunk built one
        for each (~40 ms of the H200's host apiece). `tokens`: the batch's token ids given late (decode_begin's;
        _follow's, whose tokens are the ids of the step in flight)."""
        if self.logits is None:
            ids = self.s.decode_begin(batch, sampling, ahead, tokens)
            return lambda: (ids(), None)
        if tokens is not None:
            batch.tokens = tokens()
        ids, logits = self.s.decode_sampled(batch, sampling, with_logits=True)
        return lambda: (ids, logits)

    def _take(self, step: _Step) -> None:
        """The step's tokens, taken by the sequences its rows are still of: each row's next token, or its end (an
        end-of-generation token, the limit); a row whose sequence ended since (by its text) gives its draw back,
        so that the client's next sequence draws what it would have."""
        ids, logits = step.wait()
        live = np.fromiter((c.serial == n for c, n in zip(step.rows, step.serials)), dtype=bool, count=len(ids))
        if step.sampling is not None and not live.all():
            for i in np.flatnonzero(~live).tolist():
                self.sampler.unread(int(step.slots[i]), step.sampling, i)
        self.sampler.accept_rows(step.slots[live], ids[live])
        ended = np.isin(ids, self.eog) if not self.ignore_eos else np.zeros(len(ids), dtype=bool)
        for i, (c, tok, eog, alive) in enumerate(zip(step.rows, ids.tolist(), ended.tolist(), live.tolist())):
            if not alive:
                continue
            if logits is not None:
                self.logits.setdefault(c.job, []).append(logits[i])
            step.taken.append((c, tok, eog))
            if eog:
                c.ending = STOP_EOG
                continue
            c.response.append(tok)
            if len(c.response) >= c.limit:
                c.ending = STOP_LIMIT if self.n_predict > 0 else STOP_CACHE
            c.next_token = tok

    def _settle(self, step: _Step, prompts) -> list[SequenceResult]:
        """The texts of the step's tokens; the sequences that end: at an end-of-generation token, where the text
        shows stop_text (looked for from the third token on, as llama-parallel does), at the limit."""
        finished = []
        for c, tok, eog in step.taken:
            if not eog:
                c.text.add(tok)
                if self.stop_text is not None and len(c.response) > 2 and c.text.stop_at >= 0:
                    c.ending = STOP_TEXT
            if c.ending:
                finished.append(self._finish(c, prompts, c.ending))
        return finished

    def _finish(self, c: _Client, prompts, why: str) -> SequenceResult:
        """The sequence's result, its cells freed. Its text is the one grown token by token for the stop text
        (llama-parallel's too: the pieces joined, without detokenize's clean-up of spaces), cut at the stop
        text: detokenizing the whole response again took the H200's host 1.8 ms a sequence."""
        res = SequenceResult(c.id, c.job, prompts[c.job][0], c.prompt, list(c.response), c.text.result(),
                             time.perf_counter() - c.t0, stop_reason=why)
        # its prompt's cells stay for later prompts that begin alike (llama-server's prompt cache, per client)
        c.held = len(c.prompt) if self.prefix_share and self._lends(c) else 0
        self.s.seq_rm(c.seq_id, self.n_system + c.held if c.held else -1)
        self.summary.n_prompt += len(c.prompt)
        self.summary.n_gen += len(c.response)
        c.job, c.pending, c.text, c.ending = -1, [], None, ""
        c.serial += 1
        return res

    def _skipped(self, c: _Client, job: int, prompts) -> SequenceResult:
        text, tokens = prompts[job]
        need = self._cells_needed(tokens)
        why = (f"needs {need} cells (prompt {len(tokens)} + {need - len(tokens)} generated), the cache has "
               f"{self.s.n_ctx - self.n_system} beside the system prompt") if tokens else "empty prompt"
        return SequenceResult(c.id, job, text, list(tokens), [], "", 0.0, skipped=why)


def _next_positions(rows: list[_Client]) -> tuple[np.ndarray, np.ndarray]:
    """The positions and sequence ids of one token of each client in rows, whose positions move on past it."""
    pos = np.fromiter((c.pos for c in rows), dtype=np.int32, count=len(rows))
    seq = np.fromiter((c.seq_id for c in rows), dtype=np.int32, count=len(rows))
    for c in rows:
        c.pos += 1
    return pos, seq


def _works(c: _Client) -> bool:
    """Whether the client has a token for the next step: a prompt to read, or a sequence that goes on."""
    return c.job >= 0 and (bool(c.pending) or not c.ending)


def step_budget(chunk: int | None, n_batch: int, n_ubatch: int) -> int:
    """Tokens a step of `parallel` holds (its chunked prefill's budget): `chunk` when given (0 or None: one
    micro-batch, n_ubatch), never more than n_batch."""
    return max(1, min(chunk or n_ubatch, n_batch))


def _seeded(p: SamplingParams, client: int) -> SamplingParams:
    """Each client draws from its own stream, reproducible when a seed is given."""
    from dataclasses import replace

    return replace(p, seed=p.seed + client if p.seed >= 0 else -1)
