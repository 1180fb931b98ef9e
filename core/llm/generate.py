"""Text generation for one sequence: evaluate the prompt in batches, then sample and decode
one token at a time, handing each token to a callback as soon as it exists.

When the context is full it stops and says so in its stats, or with context_shift keeps going as
llama.cpp does: the first n_keep tokens stay, half of the rest is discarded, and the later half moves
down (seq_rm, then seq_add, whose K-shift re-rotates the cached keys to their new positions). An
interrupted session (Ctrl-C) ends generation with what exists so far, never an exception.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.numerics import NonFiniteLogits
from ggrun.core.llm.sampling import Sampler
from ggrun.core.llm.session import Session


@dataclass
class GenerationStats:
    n_prompt: int = 0
    prompt_s: float = 0.0
    n_eval: int = 0  # single-token decode runs after the prompt
    eval_s: float = 0.0
    stop_reason: str = ""  # STOP_* below
    n_shifts: int = 0  # context shifts made
    n_discarded: int = 0  # tokens those shifts discarded


STOP_EOG = "end of generation token"
STOP_N_PREDICT = "n_predict reached"
STOP_CONTEXT_FULL = "context full"
STOP_INTERRUPTED = "interrupted"


def keep_for_shift(n_keep: int, prompt: list[int], add_bos: bool) -> int:
    """llama.cpp's --keep: the number of prompt tokens a context shift keeps at the start; -1 (or more
    than the prompt) keeps the whole prompt, and a BOS token the tokenizer added is always kept."""
    if n_keep < 0 or n_keep > len(prompt):
        return len(prompt)
    return min(n_keep + int(add_bos), len(prompt))


def check_prompt(session: Session, prompt: list[int], n_predict: int) -> None:
    if n_predict < 0:
        raise BadInput(f"-n {n_predict}: the number of tokens to predict must not be negative")
    if not prompt:
        raise BadInput("the prompt is empty (give -p TEXT or -f FILE)")
    if len(prompt) > session.n_ctx:
        raise BadInput(f"the prompt is {len(prompt)} tokens, longer than the context (-c {session.n_ctx})")


def eval_prompt(session: Session, prompt: list[int], n_batch: int, seq: int = 0, start_pos: int = 0) -> np.ndarray:
    """Decode the prompt in batches of n_batch tokens; logits of its last token."""
    logits = None
    for i in range(0, len(prompt), n_batch):
        chunk = prompt[i:i + n_batch]
        last = i + n_batch >= len(prompt)
        out = session.decode(Batch.of_sequence(chunk, start_pos + i, seq, last_logits=last))
        if last:
            logits = out[-1]
    return logits


def generate(session: Session, prompt: list[int], n_predict: int, sampler: Sampler,
             on_token: Callable[[int], None], ignore_eos: bool = False, context_shift: bool = False,
             n_keep: int = 0) -> tuple[list[int], GenerationStats]:
    """Generate up to n_predict tokens after `prompt`; stops at an end-of-generation token (unless
    ignore_eos), when the session is interrupted, or when the context is full: with context_shift, a
    full context discards half of what follows the first n_keep tokens and generation goes on."""
    check_prompt(session, prompt, n_predict)
    st = GenerationStats(n_prompt=len(prompt))
    tok = session.model.tokenizer
    t0 = time.perf_counter()
    decoded_before = session.stats.n_tokens
    try:
        logits = eval_prompt(session, prompt, session.params.n_batch)
    except NonFiniteLogits as err:
        raise NonFiniteLogits(err.kind, f"while evaluating the prompt ({len(prompt)} token{'s' if len(prompt) > 1 else ''})", err.culprit) from None
    except Interrupted:
        st.prompt_s = time.perf_counter() - t0
        st.n_prompt = session.stats.n_tokens - decoded_before
        st.stop_reason = STOP_INTERRUPTED
        return [], st
    st.prompt_s = time.perf_counter() - t0
    for t in prompt:
        sampler.accept(t)
    out: list[int] = []
    pos = len(prompt)
    while len(out) < n_predict:
        token = sampler.sample(logits)
        sampler.accept(token)
        if not ignore_eos and tok.is_eog(token):
            st.stop_reason = STOP_EOG
            break
        out.append(token)
        on_token(token)
        if len(out) == n_predict:
            break
        if pos >= session.n_ctx:
            n_discard = (pos - n_keep) // 2 if context_shift else 0
            if n_discard < 1:  # no shift asked for, or --keep leaves nothing to discard
                st.stop_reason = STOP_CONTEXT_FULL
                break
            session.seq_rm(0, n_keep, n_keep + n_discard)
            session.seq_add(0, n_keep + n_discard, pos, -n_discard)
            pos -= n_discard
            st.n_shifts += 1
            st.n_discarded += n_discard
        t1 = time.perf_counter()
        try:
            logits = session.decode(Batch.of_sequence([token], pos))[-1]
        except NonFiniteLogits as err:
            raise NonFiniteLogits(err.kind, f"at generation step {len(out)} (position {pos})", err.culprit) from None
        except Interrupted:
            st.stop_reason = STOP_INTERRUPTED
            break
        st.eval_s += time.perf_counter() - t1
        st.n_eval += 1
        pos += 1
    st.stop_reason = st.stop_reason or STOP_N_PREDICT
    return out, st
