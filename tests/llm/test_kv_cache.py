"""The KV cache's cell records (core.llm.kv_cache) under the paths a decode step takes: one token placed with
scalar writes, its mask opened as one slice, the window's evictions done on the few cells concerned. On
random cache states (several sequences, cells freed below the top, positions out of order, a sliding
window) they must leave the cells, counts and masks that the array formulas written out here give."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from ggrun.core.errors import BadInput
from ggrun.core.llm.kv_cache import BUCKET_FLOOR, KVCache

N_CTX = 48
PAD = 8  # small, so that n_kv follows the top closely


def new_cache(n_seq_max: int, window: int | None) -> KVCache:
    return KVCache(N_CTX, 8, [], n_seq_max=n_seq_max, pad=PAD, window=window)


def arrays(kv: KVCache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return kv.pos.copy(), kv.seqs.copy(), kv.shift.copy()


def expected_mask(kv: KVCache, pos: np.ndarray, seq: np.ndarray, n_kv: int, window: int | None) -> np.ndarray:
    """0 where a token sees a cell: its sequence's, used, not later, within the window."""
    cell_pos = kv.pos[None, :n_kv]
    visible = kv.seqs[:n_kv, seq].T & (cell_pos >= 0) & (cell_pos <= pos[:, None])
    if window is not None:
        visible &= pos[:, None] - cell_pos < window
    return np.where(visible, 0, -np.inf).astype(np.float16)


def expected_eviction(kv: KVCache, pos: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, ...]:
    """The records after evict_unseen: each sequence leaves its cells `window` or more positions before
    its first token; cells no sequence holds are freed."""
    cell_pos, seqs, shift = arrays(kv)
    for s in np.unique(seq):
        gone = seqs[:, s] & (cell_pos >= 0) & (cell_pos <= pos[seq == s].min() - kv.window)
        seqs[gone, s] = False
        emptied = gone & ~seqs.any(axis=1)
        cell_pos[emptied] = -1
        shift[emptied] = 0
    return cell_pos, seqs, shift


def expected_apply(kv: KVCache, cells: np.ndarray, pos: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, ...]:
    cell_pos, seqs, shift = arrays(kv)
    cell_pos[cells] = pos
    seqs[cells] = False
    seqs[cells, seq] = True
    return cell_pos, seqs, shift


def check_counts(kv: KVCache) -> None:
    """The numbers kept beside the cells describe them: used cells, one past the highest, and a bound
    no held position exceeds. Every used cell holds a sequence (what lets a one-sequence cache's short
    mask skip counting them)."""
    used = np.flatnonzero(kv.pos >= 0)
    assert kv.seqs[used].any(axis=1).all()
    assert kv.n_used == len(used)
    assert kv._top == (int(used[-1]) + 1 if len(used) else 0)
    if len(used):
        assert kv._max_pos >= kv.pos[used].max()
    check_cell_seqs(kv)


def check_cell_seqs(kv: KVCache) -> None:
    """fill_cell_seqs gives every cell's sequences as bits, for the first top cells and for all, although it
    packs only the cells changed since its last call."""
    words = -(-kv.n_seq_max // 32)
    want = np.zeros((kv.n_ctx, words * 4), dtype=np.uint8)
    packed = np.packbits(kv.seqs, axis=1, bitorder="little")
    want[:, :packed.shape[1]] = packed
    for n in (kv._top, kv.n_ctx):
        got = np.full((n, words), -1, dtype=np.int32)
        kv.fill_cell_seqs(got)
        np.testing.assert_array_equal(got.view(np.uint8), want[:n])


def check_same(kv: KVCache, want: tuple[np.ndarray, ...]) -> None:
    for got, exp in zip(arrays(kv), want):
        np.testing.assert_array_equal(got, exp)
    check_counts(kv)


def check_mask(kv: KVCache, pos: np.ndarray, seq: np.ndarray, window: int | None, n_kv: int) -> None:
    out = np.full((len(pos), n_kv), 7, dtype=np.float16)  # garbage the mask must overwrite
    kv.fill_mask(out, pos, seq, window)
    np.testing.assert_array_equal(out, expected_mask(kv, pos, seq, n_kv, window))
    assert np.array_equal(np.signbit(out), np.signbit(expected_mask(kv, pos, seq, n_kv, window)))


def place(kv: KVCache, pos: np.ndarray, seq: np.ndarray) -> bool:
    """A micro-batch placed as a session places it, each step checked; False when it did not fit."""
    if kv.window is not None:
        want = expected_eviction(kv, pos, seq)
        kv.evict_unseen(pos, seq)
        check_same(kv, want)
    cells = kv.find_slot(len(pos))
    free = np.flatnonzero(kv.pos < 0)
    if len(free) < len(pos):
        assert cells is None
        return False
    np.testing.assert_array_equal(cells, free[:len(pos)])
    assert cells.dtype == np.int32
    want = expected_apply(kv, cells, pos, seq)
    kv.apply(cells, pos, seq)
    check_same(kv, want)
    return True


def random_step(kv: KVCache, rng: np.random.Generator, next_pos: list[int], windows: list[int | None]) -> bool:
    """One random change: mostly a decode step of one sequence, sometimes out of order, a token written
    over a chosen cell, a multi-token micro-batch, or cells freed, shared or moved. Returns whether a
    decode step was placed."""
    n_seq = kv.n_seq_max
    r = rng.random()
    s = int(rng.integers(n_seq))
    if r < 0.6:  # decode: the next position, or now and then one behind or far ahead
        p = next_pos[s] + int(rng.choice([0, 0, 0, 0, -3, 5]))
        p = max(p, 0)
        next_pos[s] = max(next_pos[s], p + 1)
        pos, seq = np.array([p], np.int32), np.array([s], np.int32)
        if place(kv, pos, seq):
            for window in windows:
                for n_kv in {kv.n_kv(), max(1, kv._top - 1), N_CTX}:
                    check_mask(kv, pos, seq, window, n_kv)
            return True
    elif r < 0.66:  # a token written over any cell, used or not, at times at a negative position (freeing it)
        cells = rng.integers(-2, N_CTX, size=1).astype(np.int32)  # negative: counted from the end
        pos, seq = np.array([int(rng.integers(-2, 40))], np.int32), np.array([s], np.int32)
        want = expected_apply(kv, cells, pos, seq)
        kv.apply(cells, pos, seq)
        check_same(kv, want)
        next_pos[s] = max(next_pos[s], int(pos[0]) + 1)
    elif r < 0.75:  # a micro-batch of several tokens, of one or several sequences
        n = int(rng.integers(2, 6))
        seq = rng.integers(n_seq, size=n).astype(np.int32) if rng.random() < 0.5 else np.full(n, s, np.int32)
        pos = np.array([next_pos[int(q)] + i for i, q in enumerate(seq)], np.int32)
        for q in seq:
            next_pos[int(q)] = max(next_pos[int(q)], int(pos.max()) + 1)
        if place(kv, pos, seq):
            for window in windows:
                check_mask(kv, pos, seq, window, kv.n_kv())
    elif r < 0.88:
        p0 = int(rng.integers(0, max(1, next_pos[s])))
        kv.seq_rm(s, p0, p0 + int(rng.integers(1, 6)))
    elif r < 0.94:
        kv.seq_cp(s, int(rng.integers(n_seq)), 0, int(rng.integers(1, max(2, next_pos[s]))))
    elif r < 0.97:
        kv.seq_add(s, 0, -1, int(rng.choice([-2, 3])))
    else:
        kv.clear()
        next_pos[:] = [0] * n_seq
    check_counts(kv)
    return False


@pytest.mark.parametrize("n_seq_max", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seed", range(3))
def test_decode_paths_match_the_array_formulas(n_seq_max, window, seed):
    """Cells, counts and masks stay those of the formulas through random changes; the short mask (a slice)
    and the one-token row found by comparisons are each taken often enough (with several sequences too,
    while one holds all the cells) to be what was checked."""
    rng = np.random.default_rng(seed)
    kv = new_cache(n_seq_max, window)
    next_pos = [0] * n_seq_max
    windows = [None, 6] if window is None else [window]
    steps = short = rows = 0
    original = KVCache._sees_all

    def counted(self, *a):
        nonlocal short, rows
        sees = original(self, *a)
        short += sees
        rows += not sees
        return sees

    KVCache._sees_all = counted
    try:
        for _ in range(600):
            steps += random_step(kv, rng, next_pos, windows)
    finally:
        KVCache._sees_all = original
    assert steps > 150 and short > 30 and rows > 30


def test_cell_seqs_follow_random_changes_of_many_sequences():
    """Sequence bits of 40 sequences (two words a cell) through random changes, a trial's too (check_counts
    compares them with the flags after every change)."""
    rng = np.random.default_rng(5)
    kv = new_cache(40, None)
    next_pos = [0] * 40
    for i in range(300):
        random_step(kv, rng, next_pos, [None])
        cells = np.flatnonzero(kv.pos < 0)[:2]
        if i % 25 == 0 and len(cells) == 2:
            with kv.trial(cells, np.array([1, 2], np.int32), np.array([7, 39], np.int32)):
                check_counts(kv)
            check_counts(kv)


def test_in_order_decoding_takes_the_short_paths():
    """One sequence decoded in order: the cache stays packed, each mask is the slice 0..top, and with a
    window each step evicts the oldest position, the cell it frees being the next one filled."""
    kv = new_cache(1, 4)
    seq = np.zeros(1, np.int32)
    for p in range(20):
        pos = np.array([p], np.int32)
        assert place(kv, pos, seq)
        assert kv._sees_all(p, 0, 4)
        check_mask(kv, pos, seq, 4, kv.n_kv())
    assert kv.n_used == 4 and sorted(kv.pos[:4]) == [16, 17, 18, 19]


def test_a_window_cache_past_a_long_prompt_opens_rows_by_comparison():
    """A prompt longer than the window leaves free cells below used ones: until the steps have evicted
    the prompt's last cell the cache is not packed, so each decode step finds its cell among the free ones
    and opens its mask row by comparisons; then it is packed again and the slice serves. Both as the
    formulas give."""
    kv = new_cache(1, 6)
    seq = np.zeros(1, np.int32)
    assert place(kv, np.arange(10, dtype=np.int32), np.zeros(10, np.int32))
    for p in range(10, 30):
        pos = np.array([p], np.int32)
        assert place(kv, pos, seq)
        assert kv._packed() == kv._sees_all(p, 0, 6) == (p >= 15)  # position 9, in cell 9, evicted at 15
        for n_kv in (kv.n_kv(), N_CTX):
            check_mask(kv, pos, seq, 6, n_kv)
    assert kv.n_used == 6 and sorted(kv.pos[kv.pos >= 0]) == list(range(24, 30))


def test_short_mask_is_refused_when_a_cell_is_hidden():
    """A cell of another sequence, a later position, or one out of the window: the slice would open it."""
    kv = new_cache(2, None)
    place(kv, np.arange(4, dtype=np.int32), np.zeros(4, np.int32))
    assert kv._sees_all(3, 0, None) and not kv._sees_all(2, 0, None) and not kv._sees_all(3, 0, 3)
    place(kv, np.array([4], np.int32), np.array([1], np.int32))
    assert not kv._sees_all(5, 0, None)
    check_mask(kv, np.array([5], np.int32), np.array([0], np.int32), None, kv.n_kv())


@pytest.mark.parametrize("seq", [[-1], [2], [0, 2], [-1, 0]])
def test_a_sequence_id_out_of_range_changes_nothing(seq):
    kv = new_cache(2, None)
    place(kv, np.arange(3, dtype=np.int32), np.zeros(3, np.int32))
    before = copy.deepcopy(kv)
    cells = kv.find_slot(len(seq))
    with pytest.raises(BadInput, match=r"sequence id out of range 0\.\.1"):
        kv.apply(cells, np.arange(3, 3 + len(seq), dtype=np.int32), np.array(seq, np.int32))
    check_same(kv, arrays(before))
    assert (kv.n_used, kv._top, kv._max_pos) == (before.n_used, before._top, before._max_pos)


@pytest.mark.parametrize("seq", [[-1], [2], [0, 2]])
def test_a_window_cache_refuses_a_bad_sequence_id_before_evicting(seq):
    kv = new_cache(2, 4)
    place(kv, np.arange(8, dtype=np.int32), np.zeros(8, np.int32))
    before = copy.deepcopy(kv)
    with pytest.raises(BadInput, match=r"sequence id out of range 0\.\.1"):
        kv.evict_unseen(np.full(len(seq), 20, np.int32), np.array(seq, np.int32))
    check_same(kv, arrays(before))


def test_a_full_cache_gives_no_slot():
    kv = new_cache(1, None)
    assert place(kv, np.arange(N_CTX, dtype=np.int32), np.zeros(N_CTX, np.int32))
    assert kv.find_slot(1) is None
    kv.seq_rm(0, 5, 6)
    np.testing.assert_array_equal(kv.find_slot(1), [5])
    assert kv.find_slot(2) is None


def test_decode_buckets_read_at_least_the_floor_others_their_own():
    """With pow2_cells a decode step of several sequences (a bucket) reads at least BUCKET_FLOOR cells (within the
    cache), so that a run of growing caches keeps its graphs; a prompt's or one token's n_kv is the power of two
    of its cells, and the floor given to buckets does not raise it."""
    for n_ctx in (256, 2 * BUCKET_FLOOR):
        kv = KVCache(n_ctx, 8, [], n_seq_max=3, pad=PAD)
        kv.pow2_cells = True
        kv.apply(np.arange(70, dtype=np.int32), np.arange(70, dtype=np.int32), np.full(70, 1, dtype=np.int32))
        assert kv.n_kv(bucket=True) == min(n_ctx, BUCKET_FLOOR)
        assert kv.n_kv() == kv.n_kv(ahead=10) == 128
    kv.pow2_cells = False
    assert kv.n_kv(bucket=True) == 72


def test_pow2_cells_never_shrink_until_the_cache_is_cleared():
    """With masks made from the cells (pow2_cells), n_kv is a power of two of the cells in use once the batch's
    later tokens are placed, and it stays when sequences leave (a graph per smaller power of two would be
    built again), until the cache is cleared."""
    kv = KVCache(256, 8, [], n_seq_max=3, pad=PAD)
    kv.pow2_cells = True
    assert kv.n_kv(ahead=40) == 64
    kv.apply(np.arange(70, dtype=np.int32), np.arange(70, dtype=np.int32), np.full(70, 1, dtype=np.int32))
    assert kv.n_kv() == 128
    kv.seq_rm(1)
    assert kv.n_used == 0 and kv.n_kv() == 128
    kv.clear()
    assert kv.n_kv() == PAD
