"""Text generation for one sequence whose tokens stay in the session's KV cache between calls: a
prompt is evaluated in batches, then tokens are sampled and decoded one at a time, each handed to a
callback as soon as it exists. A conversation adds each turn's new tokens after the cached ones
(`Generation.extend`), so the history is never evaluated twice; `Generation.set_tokens` replaces
the sequence and keeps only the cached prefix it shares with the new one.

When the context is full it stops and says so in its stats, or with context_shift keeps going as
llama.cpp does: the first n_keep tokens stay, half of the rest is discarded, and the later half moves
down (seq_rm, then seq_add, whose K-shift re-rotates the cached keys to their new positions). An
interrupted session (Ctrl-C) ends generation with what exists so far, never an exception.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import numpy as np

from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.numerics import NonFiniteLogits
from ggrun.core.llm.sampling import Sampler
from ggrun.core.llm.session import Session

STOP_EOG = "end of generation token"
STOP_N_PREDICT = "n_predict reached"
STOP_CONTEXT_FULL = "context full"
STOP_INTERRUPTED = "interrupted"
STOP_REVERSE_PROMPT = "reverse prompt"

N_PREDICT_INFINITE = -1  # llama.cpp's -n -1: until end of generation (or a full context without --context-shift)
N_PREDICT_FILL = -2  # llama.cpp's -n -2: until the context is full, never shifting it


@dataclass
class GenerationStats:
    n_prompt: int = 0  # tokens evaluated as a prompt (batches)
    n_reused: int = 0  # tokens the prompt found already in the cache
    prompt_s: float = 0.0
    n_eval: int = 0  # single-token decode runs after the prompt
    eval_s: float = 0.0
    n_sampled: int = 0  # tokens the sampler chose (the last one of a reply is never decoded)
    sample_s: float = 0.0
    stop_reason: str = ""  # STOP_* above
    n_shifts: int = 0  # context shifts made
    n_discarded: int = 0  # tokens those shifts discarded

    def add(self, other: GenerationStats) -> None:
        """Sum another call's figures into these (the stop reason becomes the latest one)."""
        for f in fields(self):
            if f.name == "stop_reason":
                self.stop_reason = other.stop_reason or self.stop_reason
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def keep_for_shift(n_keep: int, prompt: list[int], add_bos: bool) -> int:
    """llama.cpp's --keep: the number of prompt tokens a context shift keeps at the start; -1 (or more
    than the prompt) keeps the whole prompt, and a BOS token the tokenizer added is always kept."""
    if n_keep < 0 or n_keep > len(prompt):
        return len(prompt)
    return min(n_keep + int(add_bos), len(prompt))


def check_n_predict(n_predict: int) -> None:
    if n_predict < N_PREDICT_FILL:
        raise BadInput(f"-n {n_predict}: give a number of tokens, -1 (until the end of text) or -2 (until the "
                       "context is full)")


def check_prompt(session: Session, prompt: list[int], n_predict: int) -> None:
    check_n_predict(n_predict)
    if not prompt:
        raise BadInput("the prompt is empty (give -p TEXT or -f FILE)")
    if len(prompt) > session.n_ctx:
        raise BadInput(f"the prompt is {len(prompt)} tokens, longer than the context (-c {session.n_ctx})")


def eval_prompt(session: Session, prompt: list[int], n_batch: int, seq: int = 0, start_pos: int = 0,
                decode_last: Callable[[Batch], np.ndarray] | None = None) -> np.ndarray:
    """Decode the prompt in batches of n_batch tokens; the last token's row of what the last batch's decode
    gives: its logits, or its token id where `decode_last` is Session.decode_greedy."""
    row = None
    for i in range(0, len(prompt), n_batch):
        chunk = prompt[i:i + n_batch]
        last = i + n_batch >= len(prompt)
        decode = decode_last if last and decode_last is not None else session.decode
        out = decode(Batch.of_sequence(chunk, start_pos + i, seq, last_logits=last))
        if last:
            row = out[-1]
    return row


class Generation:
    """Sequence 0 of a session, kept between calls: `tokens` is the sequence in position order (after
    context shifts, as the cache holds it), of which the first `n_cached` have their keys and values
    in the cache; the token sampled last waits outside until the next decode needs it.

    A greedy-only sampler over logits computed on a device takes each next token where they are computed
    (`on_device`: Session.decode_greedy), so that a step brings back a token id, not a row of logits."""

    def __init__(self, session: Session, sampler: Sampler, context_shift: bool = False, n_keep: int = 0) -> None:
        self.session = session
        self.sampler = sampler
        self.context_shift = context_shift
        self.n_keep = n_keep
        self.tokens: list[int] = []
        self.n_cached = 0
        self.logits: np.ndarray | None = None  # after the last token of `tokens`, when it is cached
        self.on_device = sampler.greedy_only and session.logits_on_device
        self.chosen: int | None = None  # with on_device, the token after the last of `tokens`, in place of logits
        self._decode = session.decode_greedy if self.on_device else session.decode
        self.totals = GenerationStats()

    def extend(self, new: Sequence[int]) -> GenerationStats:
        """Append `new` (a prompt or a turn) and evaluate it with whatever waits before it."""
        return self.set_tokens(self.tokens + list(new))

    def set_tokens(self, tokens: Sequence[int]) -> GenerationStats:
        """Make the sequence `tokens`: the cached prefix it shares with the current one stays, the rest of
        the cache is dropped and the remainder is evaluated (its last token at least, for fresh logits).
        Tokens that are new to the sequence join the sampler's penalty window. BadInput when they do not
        fit in the context; a Ctrl-C ends with the stats' stop reason STOP_INTERRUPTED."""
        tokens = list(tokens)
        if not tokens:
            raise BadInput("the prompt is empty (give -p TEXT or -f FILE)")
        if len(tokens) > self.session.n_ctx:
            raise BadInput(f"the prompt is {len(tokens)} tokens, longer than the context (-c {self.session.n_ctx})")
        same = common_prefix(self.tokens, tokens)
        keep = self._reusable(min(same, self.n_cached, len(tokens) - 1))
        for t in tokens[same:]:
            self.sampler.accept(t)
        if keep < self.n_cached:
            self.session.seq_rm(0, keep, -1)
        self.tokens, self.n_cached, self.logits, self.chosen = tokens, keep, None, None
        st = GenerationStats(n_reused=keep)
        t0 = time.perf_counter()
        decoded_before = self.session.stats.n_tokens
        todo = tokens[keep:]
        try:
            self._hold(eval_prompt(self.session, todo, self.session.params.n_batch, start_pos=keep,
                                   decode_last=self._decode))
            st.n_prompt = len(todo)
        except NonFiniteLogits as err:
            raise NonFiniteLogits(err.kind, f"while evaluating the prompt ({len(todo)} token{'s' if len(todo) > 1 else ''})",
                                  err.culprit) from None
        except Interrupted:
            st.n_prompt = self.session.stats.n_tokens - decoded_before
            st.stop_reason = STOP_INTERRUPTED
        self.n_cached = keep + st.n_prompt
        st.prompt_s = time.perf_counter() - t0
        self.totals.add(st)
        return st

    def _reusable(self, keep: int) -> int:
        """How much of a cached prefix of `keep` tokens can stay: all of it, unless a sliding-window cache
        (gemma3's) has already dropped keys that tokens right after the prefix would see; then none, and
        the sequence is evaluated again from the start (as llama.cpp does for such caches)."""
        swa = self.session.kv_swa
        if swa is None or keep >= self.n_cached or keep == 0:
            return keep
        held = swa.pos[swa.seqs[:, 0] & (swa.pos >= 0)]
        return keep if held.size and held.min() <= max(0, keep - swa.window + 1) else 0

    def make_room(self, n_new: int) -> GenerationStats:
        """With context_shift, shift the context (as when generating) until n_new more tokens fit after
        the sequence, as llama.cpp does before it evaluates new input; the stats count the shifts."""
        st = GenerationStats()
        while len(self.tokens) + n_new > self.session.n_ctx and self._shift(N_PREDICT_INFINITE, st):
            pass
        return self._done(st)

    def reset(self) -> None:
        """Forget the sequence: the cache drops it, and the next prompt starts at position 0."""
        if self.n_cached:
            self.session.seq_rm(0, -1, -1)
        self.tokens, self.n_cached, self.logits, self.chosen = [], 0, None, None

    def generate(self, n_predict: int, on_token: Callable[[int], None], ignore_eos: bool = False,
                 stop: Callable[[list[int]], bool] | None = None) -> tuple[list[int], GenerationStats]:
        """Sample up to n_predict tokens (-1: no limit; -2: until the context is full) after the evaluated
        sequence. Stops at an end-of-generation token (unless ignore_eos; the token joins the sequence but
        is not passed on), when stop(sequence) says so after a token (a reverse prompt), when the session
        is interrupted, or when the context is full: with context_shift (and n_predict not -2), a full
        context discards half of what follows the first n_keep tokens and generation goes on."""
        check_n_predict(n_predict)
        st = GenerationStats()
        out: list[int] = []
        limit = n_predict if n_predict >= 0 else None
        ready = self.logits is not None or self.chosen is not None
        if not ready or (limit is not None and limit == 0):
            st.stop_reason = STOP_N_PREDICT if ready else STOP_INTERRUPTED
            return out, self._done(st)
        tok = self.session.model.tokenizer
        while True:
            t0 = time.perf_counter()
            token = self._next_token()
            self.sampler.accept(token)
            st.sample_s += time.perf_counter() - t0
            st.n_sampled += 1
            self.tokens.append(token)
            if not ignore_eos and tok.is_eog(token):
                st.stop_reason = STOP_EOG
                break
            out.append(token)
            on_token(token)
            if limit is not None and len(out) == limit:
                st.stop_reason = STOP_N_PREDICT
                break
            if stop is not None and stop(self.tokens):
                st.stop_reason = STOP_REVERSE_PROMPT
                break
            if self.n_cached >= self.session.n_ctx and not self._shift(n_predict, st):
                st.stop_reason = STOP_CONTEXT_FULL
                break
            if not self._decode_last(st):
                st.stop_reason = STOP_INTERRUPTED
                break
        return out, self._done(st)

    def _hold(self, row: np.ndarray) -> None:
        """Keep what the last decode gave for the sequence's last token: its token id (on_device) or its logits."""
        if self.on_device:
            self.chosen = int(row)
        else:
            self.logits = row

    def _next_token(self) -> int:
        """The token after the sequence: the one chosen on the device, or the sampler's choice from the logits."""
        token = self.chosen if self.chosen is not None else self.sampler.sample(self.logits)
        self.logits = self.chosen = None
        return token

    def _done(self, st: GenerationStats) -> GenerationStats:
        self.totals.add(st)
        return st

    def _shift(self, n_predict: int, st: GenerationStats) -> bool:
        """Make room at the end of a full context (llama.cpp's context shift); False when none is to be made."""
        pos = self.n_cached
        n_discard = (pos - self.n_keep) // 2 if self.context_shift and n_predict != N_PREDICT_FILL else 0
        if n_discard < 1:  # no shift asked for, or --keep leaves nothing to discard
            return False
        self.session.seq_rm(0, self.n_keep, self.n_keep + n_discard)
        self.session.seq_add(0, self.n_keep + n_discard, pos, -n_discard)
        del self.tokens[self.n_keep:self.n_keep + n_discard]
        self.n_cached -= n_discard
        st.n_shifts += 1
        st.n_discarded += n_discard
        return True

    def _decode_last(self, st: GenerationStats) -> bool:
        """Decode the token sampled last; False when the session was interrupted first."""
        pos = self.n_cached
        t1 = time.perf_counter()
        try:
            self._hold(self._decode(Batch.of_sequence([self.tokens[pos]], pos))[-1])
        except NonFiniteLogits as err:
            raise NonFiniteLogits(err.kind, f"at generation step {st.n_sampled} (position {pos})", err.culprit) from None
        except Interrupted:
            return False
        self.n_cached += 1
        st.eval_s += time.perf_counter() - t1
        st.n_eval += 1
        return True


def generate(session: Session, prompt: list[int], n_predict: int, sampler: Sampler,
             on_token: Callable[[int], None], ignore_eos: bool = False, context_shift: bool = False,
             n_keep: int = 0) -> tuple[list[int], GenerationStats]:
    """Generate up to n_predict tokens after `prompt` in a fresh sequence (see Generation.generate); the
    stats cover the prompt's evaluation and the generation."""
    check_prompt(session, prompt, n_predict)
    g = Generation(session, sampler, context_shift, n_keep)
    g.extend(prompt)
    out, _ = g.generate(n_predict, on_token, ignore_eos)
    return out, g.totals


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many tokens a and b have in common from the start; compared as arrays (a prompt of thousands of
    tokens against each of 64 sequences' costs microseconds, not a Python loop each)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


class PromptTable:
    """The prompts of n slots as rows of one array (padded with -1, which no token id equals), so that a new
    prompt's common prefix with every slot's is one comparison: 64 calls of common_prefix, one a slot, took
    ~0.6 ms of the host for each sequence that joined a run of 64 (`parallel`'s joins, ~40 ms a wave)."""

    def __init__(self, n: int) -> None:
        self.rows = np.full((n, 64), -1, dtype=np.int32)
        self.lens = np.zeros(n, dtype=np.int64)

    def set(self, slot: int, ids: np.ndarray) -> None:
        """Slot `slot` holds prompt ids from now on."""
        if len(ids) > self.rows.shape[1]:
            wider = np.full((len(self.rows), max(len(ids), 2 * self.rows.shape[1])), -1, dtype=np.int32)
            wider[:, :self.rows.shape[1]] = self.rows
            self.rows = wider
        self.rows[slot, :len(ids)] = ids
        self.rows[slot, len(ids):self.lens[slot]] = -1
        self.lens[slot] = len(ids)

    def common(self, ids: np.ndarray) -> np.ndarray:
        """How many tokens each slot's prompt has in common with ids from the start (common_prefix, every slot)."""
        n = min(len(ids), self.rows.shape[1])
        if n == 0:
            return np.zeros(len(self.rows), dtype=np.int64)
        same = self.rows[:, :n] == np.asarray(ids[:n])
        return np.where(same.all(axis=1), n, same.argmin(axis=1))


class ReversePrompts:
    """llama.cpp's reverse prompts (-r): generation stops once the text of the sequence's last 32
    tokens ends with one of them (searched in its last len + 2 bytes when not interactive, where the
    prompt text may be tokenized with a following character), or when the last token is a reverse
    prompt that is one token by itself (a control token such as "<|im_end|>")."""

    N_PREV = 32

    def __init__(self, tokenizer, prompts: Sequence[str], interactive: bool) -> None:
        self.tok = tokenizer
        self.prompts = [p.encode("utf-8") for p in prompts if p]
        self.padding = 0 if interactive else 2
        single = [tokenizer.tokenize(p, add_special=False, parse_special=True) for p in prompts if p]
        self.single_tokens = {ids[0] for ids in single if len(ids) == 1}

    def __call__(self, sequence: list[int]) -> bool:
        if not sequence:
            return False
        tail = b"".join(self.tok.token_to_piece(t) for t in sequence[-self.N_PREV:])
        for prompt in self.prompts:
            if tail.find(prompt, max(len(tail) - len(prompt) - self.padding, 0)) >= 0:
                return True
        return sequence[-1] in self.single_tokens
