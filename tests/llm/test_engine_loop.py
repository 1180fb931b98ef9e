"""EngineLoop (`ggrun serve`'s engine): requests decoded together in slots give the tokens each gives alone;
a prompt whose prefix a slot holds decodes only the rest; without continuous batching a new request waits for
the batch in flight to finish; an idle loop starts requests still arriving in the first request's step; a
cancelled request frees its slot; the queue is
bounded; stop strings cut the text, streamed and whole alike; a seed repeats a draw; a constraint's mask
holds every token drawn; log-probabilities are the logits' log-softmax. Synthetic tiny llama."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.llm.engine_loop import (FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, GATHER_S, DoneEvent, EngineLoop,
                                        QueueFull, Request, TokenEvent)
from ggrun.core.llm.generate import generate
from ggrun.core.llm.logprobs import row_logprobs
from ggrun.core.llm.model import Model
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams

GREEDY = SamplingParams(temp=0.0)
_rng = np.random.default_rng(11)
PROMPTS = [[int(t) for t in _rng.integers(0, 256, n)] for n in (5, 13, 3, 21, 8, 1)]


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


class Collector:
    """The events of one request; `wait` returns its DoneEvent."""

    def __init__(self) -> None:
        self.tokens: list[TokenEvent] = []
        self.done: DoneEvent | None = None
        self._ev = threading.Event()

    def __call__(self, ev) -> None:
        if isinstance(ev, DoneEvent):
            self.done = ev
            self._ev.set()
        else:
            self.tokens.append(ev)

    def wait(self) -> DoneEvent:
        assert self._ev.wait(60), "the request did not finish"
        return self.done

    @property
    def ids(self) -> list[int]:
        return [t.token for t in self.tokens]

    @property
    def streamed(self) -> str:
        return "".join(t.text for t in self.tokens)


def engine(model: Model, n_slots: int = 3, n_ctx: int = 512, max_queue: int = 16,
           cont_batching: bool = True, gather_s: float = GATHER_S) -> EngineLoop:
    s = Session(model, SessionParams(n_ctx=n_ctx, n_seq_max=n_slots))
    return EngineLoop(s, n_slots, 512, max_queue, cont_batching, gather_s)


def alone(model: Model, prompt: list[int], n: int, params: SamplingParams = GREEDY) -> list[int]:
    s = Session(model, SessionParams(n_ctx=512))
    out, _ = generate(s, prompt, n, Sampler(params, 512), lambda t: None, ignore_eos=True)
    return out


def run(e: EngineLoop, reqs: list[Request]) -> list[Collector]:
    cols = [Collector() for _ in reqs]
    for r, c in zip(reqs, cols):
        e.submit(r, c)
    for c in cols:
        c.wait()
    return cols


def test_requests_in_slots_give_the_tokens_each_gives_alone(tiny):
    e = engine(tiny)
    e.start()
    try:
        cols = run(e, [Request(p, GREEDY, 7, ignore_eos=True) for p in PROMPTS])
    finally:
        e.stop()
    for p, c in zip(PROMPTS, cols):
        assert c.done.finish_reason == FINISH_LENGTH
        assert c.ids == alone(tiny, p, 7)
        assert c.streamed == c.done.text
    assert e.metrics.tokens_predicted == 7 * len(PROMPTS)


def test_a_slot_holding_the_prefix_decodes_only_the_rest(tiny):
    e = engine(tiny, n_slots=2)
    e.start()
    try:
        first = run(e, [Request(PROMPTS[3], GREEDY, 4, ignore_eos=True)])[0]
        again = run(e, [Request(PROMPTS[3] + [7, 8], GREEDY, 4, ignore_eos=True)])[0]
        fresh = run(e, [Request(PROMPTS[3] + [7, 8], GREEDY, 4, ignore_eos=True, cache_prompt=False)])[0]
    finally:
        e.stop()
    assert first.done.n_cached == 0
    assert again.done.n_cached == len(PROMPTS[3])
    assert fresh.done.n_cached == 0
    assert again.ids == fresh.ids == alone(tiny, PROMPTS[3] + [7, 8], 4)


def test_a_request_takes_a_longer_prefix_from_another_busy_slot(tiny):
    """A request whose prompt begins with what a busy slot holds shares that slot's cells (no slot of its own
    holds any of it) and decodes only the rest; both get the tokens each gets alone."""
    e = engine(tiny, n_slots=2)
    e.start()
    try:
        first = Collector()
        e.submit(Request(PROMPTS[3] + [7, 8], GREEDY, 12, ignore_eos=True), first)
        deadline = time.monotonic() + 60
        while not first.tokens and time.monotonic() < deadline:
            time.sleep(0.001)
        second = run(e, [Request(PROMPTS[3] + [9], GREEDY, 4, ignore_eos=True)])[0]
        first.wait()
    finally:
        e.stop()
    assert first.done.n_cached == 0
    assert second.done.n_cached == len(PROMPTS[3])
    assert first.ids == alone(tiny, PROMPTS[3] + [7, 8], 12)
    assert second.ids == alone(tiny, PROMPTS[3] + [9], 4)


@pytest.mark.parametrize("cont_batching", [True, False])
def test_without_cont_batching_a_new_request_waits_for_the_batch_in_flight(tiny, cont_batching):
    """B is submitted once A has its first token (a slot is free for B): with -cb B's first token comes while
    A generates; with -nocb only after A is done (llama-server's update_slots), and B's tokens are the same."""
    e = engine(tiny, n_slots=2, cont_batching=cont_batching)
    order: list[str] = []
    a, b = Collector(), Collector()

    def on_a(ev) -> None:
        order.append("A done" if isinstance(ev, DoneEvent) else "A")
        a(ev)
        if len(order) == 1:
            e.submit(Request(PROMPTS[1], GREEDY, 4, ignore_eos=True), on_b)

    def on_b(ev) -> None:
        order.append("B done" if isinstance(ev, DoneEvent) else "B")
        b(ev)

    e.start()
    try:
        e.submit(Request(PROMPTS[0], GREEDY, 12, ignore_eos=True), on_a)
        a.wait()
        b.wait()
    finally:
        e.stop()
    first_b, a_done = order.index("B"), order.index("A done")
    assert (first_b < a_done) == cont_batching, order
    assert b.ids == alone(tiny, PROMPTS[1], 4)


def test_an_idle_loop_holds_its_first_step_for_requests_still_arriving(tiny):
    """A is submitted while B is still being read (its Arrival open): A waits in its slot, and both prompts go into
    one step once B is submitted (a burst is not split into the first prompt's step and the rest's). An arrival
    refused before its submit, or none at all (one client), holds nothing: with a wait of 600 s, a request that
    waited would outlast the Collector's 60 s."""
    e = engine(tiny, n_slots=2, gather_s=600)
    steps: list[int] = []
    real = e.s.decode_greedy

    def recording(batch):
        steps.append(len(batch))
        return real(batch)

    e.s.decode_greedy = recording
    with e.arrival():  # refused (a bad body): closed on leaving its `with`
        pass
    arriving = e.arrival()
    a, b = Collector(), Collector()
    e.submit(Request(PROMPTS[0], GREEDY, 2, ignore_eos=True), a)
    e.start()
    try:
        while e.n_processing < 1:
            threading.Event().wait(0.01)
        assert not steps  # A is admitted, and held for B
        e.submit(Request(PROMPTS[1], GREEDY, 2, ignore_eos=True), b, arriving)
        a.wait()
        b.wait()
        lone = run(e, [Request(PROMPTS[2], GREEDY, 2, ignore_eos=True)])[0]
    finally:
        e.stop()
    assert not arriving.open
    assert steps[0] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert a.ids == alone(tiny, PROMPTS[0], 2) and b.ids == alone(tiny, PROMPTS[1], 2)
    assert lone.done.finish_reason == FINISH_LENGTH


def test_cancel_frees_the_slot_and_the_queue_is_bounded(tiny):
    e = engine(tiny, n_slots=1, max_queue=1)
    long = Collector()
    h = e.submit(Request(PROMPTS[0], GREEDY, -1, ignore_eos=True), long)
    queued = Collector()
    e.submit(Request(PROMPTS[1], GREEDY, 3, ignore_eos=True), queued)
    with pytest.raises(QueueFull):  # one in the (free) slot's place, one waiting: the bound
        e.submit(Request(PROMPTS[2], GREEDY, 3), Collector())
    e.start()
    try:
        while len(long.tokens) < 3:
            threading.Event().wait(0.01)
        e.cancel(h)
        assert long.wait().finish_reason == FINISH_CANCELLED
        assert queued.wait().finish_reason == FINISH_LENGTH
        assert queued.ids == alone(tiny, PROMPTS[1], 3)
    finally:
        e.stop()
    assert e.n_processing == 0 and e.n_deferred == 0


def test_stop_strings_cut_the_text_streamed_and_whole(tiny):
    e = engine(tiny)
    e.start()
    try:
        plain = run(e, [Request(PROMPTS[1], GREEDY, 24, ignore_eos=True)])[0]
        text = plain.done.text
        stop = text[len(text) // 2: len(text) // 2 + 2]
        assert len(stop) == 2
        cut = run(e, [Request(PROMPTS[1], GREEDY, 24, (stop, "\x00never"), ignore_eos=True)])[0]
    finally:
        e.stop()
    assert cut.done.finish_reason == FINISH_STOP and cut.done.stop_word == stop
    assert cut.done.text == text[:text.index(stop)]
    assert cut.streamed == cut.done.text


def test_a_seed_repeats_its_draws(tiny):
    hot = SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    e = engine(tiny)
    e.start()
    try:
        a, b = run(e, [Request(PROMPTS[2], hot, 10, ignore_eos=True), Request(PROMPTS[2], hot, 10, ignore_eos=True)])
    finally:
        e.stop()
    assert a.ids == b.ids == alone(tiny, PROMPTS[2], 10, hot)


class EvenTokens:
    """A constraint that allows even token ids only, for 5 tokens."""

    def __init__(self, n_vocab: int) -> None:
        self.mask = np.arange(n_vocab) % 2 == 0
        self.seen: list[int] = []

    def allowed(self) -> np.ndarray:
        return self.mask

    def accept(self, token: int) -> None:
        self.seen.append(token)

    @property
    def done(self) -> bool:
        return len(self.seen) >= 5


def test_a_constraint_masks_every_draw_and_logprobs_are_the_log_softmax(tiny):
    e = engine(tiny)
    c = EvenTokens(tiny.hp.n_vocab)
    e.start()
    try:
        masked, probed = run(e, [Request(PROMPTS[4], SamplingParams(temp=1.0, seed=3), 50, ignore_eos=True,
                                         constraint=c),
                                 Request(PROMPTS[4], GREEDY, 3, ignore_eos=True, n_probs=4, logprobs=True)])
    finally:
        e.stop()
    assert masked.done.finish_reason == FINISH_STOP and len(masked.ids) == 5
    assert all(t % 2 == 0 for t in masked.ids) and c.seen == masked.ids
    assert probed.ids == alone(tiny, PROMPTS[4], 3)
    first = probed.tokens[0].logprob
    assert [t for t, _ in first.top][0] == probed.ids[0]  # greedy: the drawn token is the likeliest
    assert first.logprob == pytest.approx(first.top[0][1])
    assert all(a[1] >= b[1] for a, b in zip(first.top, first.top[1:]))


def test_row_logprobs_is_the_log_softmax():
    logits = np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)
    lp = row_logprobs(logits, 2, 3)
    ref = logits - np.log(np.exp(logits).sum())
    assert lp.logprob == pytest.approx(ref[2])
    assert lp.top == [(1, pytest.approx(ref[1])), (3, pytest.approx(ref[3])), (2, pytest.approx(ref[2]))]


def test_a_fault_in_a_step_ends_its_requests_and_the_loop_goes_on(tiny):
    e = engine(tiny, n_slots=2)
    real = e.s.decode_greedy
    calls = []

    def failing_once(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("a kernel failed")
        return real(batch)

    e.s.decode_greedy = failing_once
    e.start()
    try:
        failed = run(e, [Request(PROMPTS[0], GREEDY, 4, ignore_eos=True)])[0]
        after = run(e, [Request(PROMPTS[0], GREEDY, 4, ignore_eos=True)])[0]
    finally:
        e.stop()
    assert failed.done.finish_reason == "error" and "a kernel failed" in failed.done.error
    assert after.done.finish_reason == FINISH_LENGTH and after.done.n_cached == 0
    assert after.ids == alone(tiny, PROMPTS[0], 4)
