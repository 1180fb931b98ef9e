"""A decode step readied while the device computes the one before it (core/llm/ready_step.py): taken when
the next batch is that step, dropped otherwise, and never visible: logits, cells and reuse decisions equal
those of a session that readies nothing, over random histories of steps, prompts and sequence edits, for
one sequence and for steps of several (buckets), greedy, sampled and with logits."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.llm.batch import Batch
from ggrun.core.llm import graph_reuse
from ggrun.core.llm.batched_sampler import BatchedSampler
from ggrun.core.llm.model import Model
from ggrun.core.llm.sampling import SamplingParams
from ggrun.core.llm.session import Session, SessionParams

N_CTX = 64
N_SEQ = 2


@pytest.fixture(scope="module")
def offloaded(tiny_llama_factory):
    """The tiny llama with every layer and the head on the stand-in device: logits come off the CPU."""
    return Model.load(tiny_llama_factory(n_layer=2), [SimBackend(), CPUBackend()], 99)


class Counted(Session):
    """A session that counts the readied steps it takes."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.taken = 0

    def _take(self, ready, batch, sampling, defer=False, tokens=None):
        self.taken += 1
        return super()._take(ready, batch, sampling, defer, tokens)


class Unready(Session):
    """The reference: a session that never readies a step."""

    def _ready_next(self, st, res):
        return None


def pair(model: Model, n_seq: int = N_SEQ) -> tuple[Counted, Unready]:
    params = SessionParams(n_ctx=N_CTX, n_seq_max=n_seq, n_ubatch=16)
    return Counted(model, params), Unready(model, params)


def cells(s: Session) -> tuple:
    kv = s.kv
    return kv.pos.tolist(), kv.seqs.tolist(), kv.n_used, kv.n_kv(), kv._max_pos, kv.shift.tolist()


def both(a: Session, b: Session, act) -> None:
    """Do the same to both sessions: equal logits (bitwise) and equal cells after."""
    ra, rb = act(a), act(b)
    if ra is not None:
        assert np.array_equal(ra, rb)
    assert cells(a) == cells(b)


def step(token: int, pos: int, seq: int = 0, logits: bool = True):
    return lambda s: s.decode(Batch.of_sequence([token], pos, seq, last_logits=logits))


def test_steps_of_one_sequence_are_readied_and_taken(offloaded):
    on, off = pair(offloaded)
    both(on, off, lambda s: s.decode(Batch.of_sequence([5, 17, 2, 44], 0)))
    assert on._ready is None  # a prompt's micro-batch readies nothing
    for i in range(10):
        both(on, off, step(3 + i, 4 + i))
        assert on._ready is not None and on._ready.st.ub.pos[0] == 5 + i
    assert off._ready is None
    assert on.taken == 9  # every step after the first
    assert on.stats.reuse_log == off.stats.reuse_log
    assert on.stats.graphs_reused == off.stats.graphs_reused


def test_a_readied_step_leaves_the_cells_as_they_were(offloaded):
    on, off = pair(offloaded)
    both(on, off, lambda s: s.decode(Batch.of_sequence([5, 17], 0)))
    both(on, off, step(9, 2))
    assert on._ready is not None
    assert on.kv.changes == off.kv.changes and on.kv.n_free() == off.kv.n_free()


@pytest.mark.parametrize("other", ["another position", "another sequence", "no logits", "two tokens",
                                   "seq_rm", "clear", "seq_cp"])
def test_a_readied_step_is_dropped_for_anything_else(offloaded, other):
    on, off = pair(offloaded)
    both(on, off, lambda s: s.decode(Batch.of_sequence([5, 17, 2], 0)))
    both(on, off, step(9, 3))
    assert on._ready is not None
    acts = {"another position": [step(4, 6)], "another sequence": [step(4, 0, seq=1)],
            "no logits": [step(4, 4, logits=False)], "two tokens": [lambda s: s.decode(Batch.of_sequence([4, 8], 4))],
            "seq_rm": [lambda s: s.seq_rm(0, 3), step(4, 3)], "clear": [lambda s: s.clear(), step(4, 0)],
            "seq_cp": [lambda s: s.seq_cp(0, 1), step(4, 4)]}
    for act in acts[other]:
        both(on, off, act)
    assert on.taken == 0


def test_random_histories_decode_alike_with_and_without_readied_steps(offloaded):
    """Mostly next steps (the readied ones), with prompts, skipped positions, steps without logits, a
    second sequence, removals, copies, shifts and clears between them."""
    on, off = pair(offloaded)
    rng = np.random.default_rng(7)
    nxt = [0] * N_SEQ  # each sequence's next position
    seq = 0
    for _ in range(120):
        seq = seq if rng.random() < 0.8 else 1 - seq
        kind = rng.choice(["next", "prompt", "skip", "quiet", "rm", "cp", "add", "clear"],
                          p=[0.6, 0.08, 0.06, 0.06, 0.06, 0.05, 0.04, 0.05])
        if on.kv.n_free() < 6:
            kind = "clear"
        tok = int(rng.integers(1, 40))
        if kind == "next":
            both(on, off, step(tok, nxt[seq], seq))
            nxt[seq] += 1
        elif kind == "prompt":
            both(on, off, lambda s: s.decode(Batch.of_sequence([tok, tok + 1, tok + 2], nxt[seq], seq)))
            nxt[seq] += 3
        elif kind == "skip":
            nxt[seq] += 2
            both(on, off, step(tok, nxt[seq], seq))
            nxt[seq] += 1
        elif kind == "quiet":
            both(on, off, step(tok, nxt[seq], seq, logits=False))
            nxt[seq] += 1
        elif kind == "rm":
            keep = int(rng.integers(0, nxt[seq] + 1))
            both(on, off, lambda s: s.seq_rm(seq, keep))
            nxt[seq] = keep
        elif kind == "cp":
            both(on, off, lambda s: s.seq_cp(seq, 1 - seq))
            nxt[1 - seq] = max(nxt)
        elif kind == "add":
            both(on, off, lambda s: s.seq_add(seq, 0, -1, 1))
            nxt[seq] += 1
        else:
            both(on, off, lambda s: s.clear())
            nxt = [0] * N_SEQ
    assert on.taken > 20
    assert on.stats.reuse_log == off.stats.reuse_log


def test_nothing_is_readied_when_the_cpu_makes_the_logits(tiny_llama_factory):
    """On the CPU the inputs share the compute buffer with the logits, read after the step; and no device
    runs meanwhile."""
    s = Session(Model.load(tiny_llama_factory(n_layer=2), [CPUBackend()]), SessionParams(n_ctx=N_CTX))
    s.decode(Batch.of_sequence([5, 17], 0))
    s.decode(Batch.of_sequence([9], 2))
    assert s._ready is None


def steps_of(seqs: list[int], pos: list[int], tokens: list[int]) -> Batch:
    """One token of each of the sequences, each asking logits."""
    n = len(seqs)
    return Batch(np.array(tokens, np.int32), np.array(pos, np.int32), np.array(seqs, np.int32), np.ones(n, bool))


@pytest.mark.parametrize("how", ["greedy", "logits", "sampled"])
def test_steps_of_several_sequences_are_readied_and_taken(offloaded, how, monkeypatch):
    """Five sequences decode together (a bucket of 8, three padding rows), then one leaves: every step after a
    bucket's first is taken readied, sampled ones with the rows given at the step, and the ids or logits are
    the unreadied session's; a step of other sequences, or after a removal, is not taken. Lending is off here
    (BORROW_USES 0), so that four sequences get the graph of bucket 4 at once: a step that runs a larger kept
    graph (GraphCache.borrow) is not readied."""
    monkeypatch.setattr(graph_reuse, "BORROW_USES", 0)
    on, off = pair(offloaded, 6)
    samplers = [BatchedSampler([SamplingParams(seed=q, temp=0.8, top_k=5) for q in range(6)], N_CTX) for _ in (0, 1)]
    for q in range(5):
        both(on, off, lambda s: s.decode(Batch.of_sequence([3 + q, 9], 0, q)))
    seqs, pos = [0, 1, 2, 3, 4], [2] * 5
    taken = []
    for i in range(8):
        if i == 5:
            both(on, off, lambda s: s.seq_rm(2))
            seqs, pos = [0, 1, 3, 4], pos[:4]
        batch = steps_of(seqs, pos, [7 + i] * len(seqs))
        before = on.taken
        if how == "sampled":
            rows = [sm.rows(np.array(seqs)) for sm in samplers]
            ra, rb = on.decode_sampled(batch, rows[0]), off.decode_sampled(batch, rows[1])
            assert np.array_equal(ra, rb)
            for sm in samplers:
                sm.accept_rows(np.array(seqs), ra)
            assert cells(on) == cells(off)
        else:
            both(on, off, lambda s: s.decode_greedy(batch) if how == "greedy" else s.decode(batch))
        taken.append(on.taken - before)
        pos = [p + 1 for p in pos]
    assert taken == [0, 1, 1, 1, 1, 0, 1, 1]
    assert on.stats.reuse_log == off.stats.reuse_log
    assert on._ready is not None and on._ready.n == 4 and on._ready.st.ub.n_tokens == 4
    both(on, off, lambda s: s.decode_greedy(steps_of([0, 1, 3], pos[:3], [5, 5, 5])))
    assert on.taken == sum(taken)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_steps_left_computing_give_the_ids_of_steps_waited_for(offloaded, sampled):
    """decode_begin leaves a step computing and hands back what waits for its ids: readied steps are taken as
    with decode_greedy or decode_sampled, the ids are theirs, and a decode made before the ids are asked for
    waits for the step first (its ids stay there to be asked for)."""
    on, sync = pair(offloaded, 4)[0], pair(offloaded, 4)[0]  # sync: decode_greedy or decode_sampled
    samplers = [BatchedSampler([SamplingParams(seed=q, temp=0.8, top_k=5) for q in range(4)], N_CTX) for _ in (0, 1)]
    for q in range(3):
        both(on, sync, lambda s: s.decode(Batch.of_sequence([3 + q, 9], 0, q)))
    seqs, pos, tokens = np.arange(3), [2] * 3, [7, 7, 7]
    for i in range(6):
        batch = steps_of(seqs, pos, tokens)
        rows = [sm.rows(seqs) for sm in samplers] if sampled else [None, None]
        waiting = on.decode_begin(batch, rows[0])
        want = sync.decode_sampled(batch, rows[1]) if sampled else sync.decode_greedy(batch)
        if i == 3:  # the next step is decoded before this one's ids are asked for
            both(on, sync, lambda s: s.decode_greedy(steps_of(seqs, [p + 1 for p in pos], want)))
            pos = [p + 1 for p in pos]
        got = waiting()
        assert np.array_equal(got, want) and np.array_equal(waiting(), want)
        assert cells(on) == cells(sync)
        if sampled:
            for sm in samplers:
                sm.accept_rows(seqs, got)
        pos, tokens = [p + 1 for p in pos], got
    assert on.taken == sync.taken >= 3
    assert on.stats.reuse_log == sync.stats.reuse_log


def test_tokens_given_late_are_asked_for_once_a_readied_steps_cells_are_recorded(offloaded):
    """decode_begin(tokens=...): for a readied step the token ids are asked for only after its cells are recorded
    and its sampling rows written (parallel's next step waits there for the ids of the step in flight), for any
    other step before anything is placed; either way the ids and cells are those of the steps given their
    tokens at once."""
    late, early = pair(offloaded, 4)[0], pair(offloaded, 4)[0]
    samplers = [BatchedSampler([SamplingParams(seed=q, temp=0.8, top_k=5) for q in range(4)], N_CTX) for _ in (0, 1)]
    for q in range(3):
        both(late, early, lambda s: s.decode(Batch.of_sequence([3 + q, 9], 0, q)))
    seqs, pos, tokens = np.arange(3), [2] * 3, [7, 7, 7]
    for i in range(5):
        rows = [sm.rows(seqs) for sm in samplers]
        want = early.decode_begin(steps_of(seqs, pos, tokens), rows[1])()
        used, taken, asked = late.kv.n_used, late.taken, []

        def give(t=tuple(tokens)):
            asked.append(late.kv.n_used)
            return np.array(t, dtype=np.int32)

        got = late.decode_begin(steps_of(seqs, pos, [0, 0, 0]), rows[0], tokens=give)()
        assert np.array_equal(got, want) and cells(late) == cells(early)
        assert asked == [used + 3 if late.taken > taken else used]
        for sm in samplers:
            sm.accept_rows(seqs, got)
        pos, tokens = [p + 1 for p in pos], got.tolist()
    assert late.taken == early.taken >= 3
