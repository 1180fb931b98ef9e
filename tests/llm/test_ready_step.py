"""A decode step readied while the device computes the one before it (core/llm/ready_step.py): taken when
the next batch is that step, dropped otherwise, and never visible: logits, cells and reuse decisions equal
those of a session that readies nothing, over random histories of steps, prompts and sequence edits."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
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

    def _take(self, ready, batch):
        self.taken += 1
        return super()._take(ready, batch)


class Unready(Session):
    """The reference: a session that never readies a step."""

    def _ready_next(self, st, res):
        return None


def pair(model: Model) -> tuple[Counted, Unready]:
    params = SessionParams(n_ctx=N_CTX, n_seq_max=N_SEQ, n_ubatch=16)
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
        assert on._ready is not None and on._ready.ub.pos[0] == 5 + i
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
