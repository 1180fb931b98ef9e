"""The KV cache: per-layer K and V tensors in immediate contexts on each layer's backend,
and the cells that record which position and sequences each row holds.

Writes happen inside the graph (set_rows at row indices given as input data), and which cells a
token sees is the mask, also input data: so freeing cells (seq_rm, clear) leaves a kept graph
valid, as llama.cpp reuses its graph after a memory clear. Re-positioning cells (seq_add) bumps
`version`, which invalidates a kept graph: their keys are re-rotated first.

K and V each have a type, as llama.cpp's -ctk / -ctv: f16, f32, or the blocks of Q8_0 / Q4_0
(each row one token's heads, quantized as it is written). A quantized cache's rows are first
turned by a Walsh-Hadamard rotation, as llama.cpp does (its attn_rot): queries meet the keys
turned alike, and attention's result is turned back, so nothing changes but the rounding.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ggrun.core import ops
from ggrun.core.context import ImmediateContext
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.graph import Graph, build_graph
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.inputs import InpKShift
from ggrun.core.llm.kv_blocks import find_cells
from ggrun.core.tensor import Tensor, new_tensor

KV_PAD = 256
CACHE_TYPES = (DType.F16, DType.F32, DType.Q8_0, DType.Q4_0)  # -ctk / -ctv

BUCKET_FLOOR = 16384  # the fewest cells a decode step of several sequences reads with pow2_cells (n_kv)


@dataclass
class CacheRows:
    """The cache tensors of one layer."""

    k: Tensor
    v: Tensor


def planned_bytes(n_ctx: int, n_embd_kv: int, layer_backends: list, type_k: DType = DType.F16,
                  type_v: DType = DType.F16, **_) -> dict[str, int]:
    """Bytes per backend name that a KVCache made with these arguments takes for its K and V rows
    (whole blocks for a quantized type), known before it exists (so that a session can check they
    fit before allocating them)."""
    layer = sum(max(n_ctx * t.row_bytes(n_embd_kv), 1) for t in (type_k, type_v))
    out: dict[str, int] = {}
    for backend in layer_backends:
        if backend is not None:
            out[backend.name] = out.get(backend.name, 0) + layer
    return out


def check_cache_types(type_k: DType, type_v: DType, head_dim: int, flash_attn: bool) -> None:
    """llama.cpp's rules for the cache types: a known type each; a quantized type's blocks must divide
    a head's size; without flash attention V must not be quantized (attention products read it
    transposed, which blocks cannot be)."""
    for flag, t in (("-ctk", type_k), ("-ctv", type_v)):
        if t not in CACHE_TYPES:
            raise BadInput(f"KV cache type {flag} {t} is not supported (use f16, f32, q8_0 or q4_0)")
        if t.is_quantized and head_dim % t.block_size:
            raise BadInput(f"KV cache type {flag} {t}: its blocks of {t.block_size} do not divide the "
                           f"model's head size {head_dim}")
    if type_v.is_quantized and not flash_attn:
        raise BadInput(f"a quantized V cache (-ctv {type_v}) needs flash attention (-fa on)")


def rotation_size(dtype: DType, head_dim: int, widest: bool) -> int:
    """Size of the Walsh-Hadamard rotation llama.cpp gives the rows of a cache of `dtype` (its
    attn_rot): none for f16 / f32, nor unless 64 divides the head size; then 64 for V, and for K
    (`widest`) the largest power of two that divides the head size."""
    if not dtype.is_quantized or head_dim % 64:
        return 0
    n = 64
    while widest and head_dim % (2 * n) == 0:
        n *= 2
    return n


def writes_cache(backend, dtype: DType) -> bool:
    """Whether `backend` runs the row writes into a cache of `dtype` that lives in its memory (a
    backend that leaves them to another would write into a copy)."""
    cache = new_tensor("cache", dtype, (1, dtype.block_size))
    rows = new_tensor("rows", DType.F32, (1, dtype.block_size))
    return backend.supports_op(ops.set_rows(cache, rows, new_tensor("idx", DType.I32, (1,))))


def heads_view(rows: Tensor, n_kv: int, n_head: int, head_dim: int) -> Tensor:
    """The first n_kv cells of a layer's K or V rows as [n_kv, n_head, head_dim] (any cache type)."""
    elem = 0 if rows.dtype.is_quantized else rows.dtype.itemsize
    return ops.view(rows, (n_kv, n_head, head_dim), (rows.strides[0], rows.dtype.row_bytes(head_dim), elem))


def build_k_shift_blocks(hp: HParams, kv: "KVCache", mode: int, freq_base_of=lambda il: None,
                         factors: Tensor | None = None) -> tuple[Graph, InpKShift]:
    """The K-shift graph (core.llm.blocks.build_k_shift) of a quantized K cache: each layer's rows
    re-rotated by their cells' position deltas in one node that decodes them, turns them back from
    their Walsh-Hadamard rotation, applies RoPE, turns and quantizes them again (llama.cpp's cast,
    rope and cpy). Like llama.cpp it requantizes every cell, those with a delta of 0 too."""
    shift = InpKShift(kv.n_ctx)
    outs = []
    for il, rows in kv.layers.items():
        base = freq_base_of(il)
        outs.append(ops.rope_shift(rows.k, shift.tensor, hp.head_dim, hp.n_rot, mode,
                                   hp.rope_freq_base if base is None else base, hp.rope_freq_scale,
                                   name=f"k_shift-{il}", yarn=hp.extra.get("yarn"), factors=factors))
    return build_graph(outs), shift


def cell_record_bytes(n_seq_max: int) -> int:
    """Host bytes of one cell's records: position and shift (int32 each), one flag per sequence."""
    return 4 + 4 + n_seq_max


class KVCache:
    """n_ctx cells shared by up to n_seq_max sequences, holding K and V of the layers given a
    backend (`layer_backends[il]`; None for a layer another cache holds).

    With a `window` it is a sliding-window cache (llama.cpp's iSWA): its layers only attend to
    the last `window` positions, so cells that no token can see again are reused, and it needs
    only about window + n_ubatch cells whatever the context.

    Beside the cells it keeps two numbers: how many are used, and one past the highest used cell, so that
    a decode step finds its cell and the cells to attend without scanning all n_ctx of them. They always
    describe `pos`: apply, seq_rm and the window's eviction update them, every other change of `pos` counts
    them again (_recount). A third bounds the positions held (`_max_pos`, none above it): exact after a count
    and raised by apply, it stays where it is when cells are freed, so it may end above them, which only
    costs a decode step its short mask (fill_mask).
    """

    def __init__(self, n_ctx: int, n_embd_kv: int, layer_backends: list, n_seq_max: int = 1,
                 type_k: DType = DType.F16, type_v: DType = DType.F16, head_dim: int | None = None,
                 pad: int = KV_PAD, virtual: bool = False, llama_numerics: bool = False,
                 window: int | None = None, name: str = "cache") -> None:
        head_dim = n_embd_kv if head_dim is None else head_dim
        check_cache_types(type_k, type_v, head_dim, flash_attn=True)
        for backend in {b.name: b for b in layer_backends if b is not None}.values():
            for flag, t in (("-ctk", type_k), ("-ctv", type_v)):
                if t.is_quantized and not writes_cache(backend, t):
                    raise BadInput(f"a {t} KV cache ({flag} {t}) cannot live on {backend.name}, which does not "
                                   f"write quantized caches: keep those layers on the CPU (lower -ngl) or use f16")
        self.n_ctx = n_ctx
        self.window = window
        self.n_seq_max = n_seq_max
        self.pad = pad
        self.type_k, self.type_v = type_k, type_v
        self.contexts: dict[str, ImmediateContext] = {}
        self.layers: dict[int, CacheRows] = {}
        for il, backend in enumerate(layer_backends):
            if backend is None:
                continue
            ctx = self.contexts.setdefault(backend.name, ImmediateContext(backend, "kv", virtual=virtual))
            # zeroed: masked cells must hold no NaN garbage
            k = ctx.new_tensor(f"{name}_k_l{il}", type_k, (n_ctx, n_embd_kv), zeroed=True)
            v = ctx.new_tensor(f"{name}_v_l{il}", type_v, (n_ctx, n_embd_kv), zeroed=True)
            for t, widest in ((k, True), (v, False)):
                rotation = rotation_size(t.dtype, head_dim, widest)
                if rotation:
                    t.params["hadamard"] = rotation
                # llama numerics: what the operand that meets the cache is rounded to (ggml's vec_dot
                # type: f16 against f16 rows, Q8_0 blocks against quantized keys)
                if llama_numerics and t.dtype is DType.F16:
                    t.params["act_quant"] = "f16"
                elif llama_numerics and t is k and t.dtype.is_quantized:
                    t.params["act_quant"] = "q8_0"
            self.layers[il] = CacheRows(k, v)
        self.pos = np.full(n_ctx, -1, dtype=np.int32)
        self.seqs = np.zeros((n_ctx, n_seq_max), dtype=bool)
        # seqs packed as fill_cell_seqs gives them, repacked only where seqs changed since (_stale, _touch)
        self._bits = np.zeros((n_ctx, -(-n_seq_max // 32) * 4), dtype=np.uint8)
        self._stale = np.ones(n_ctx, dtype=bool)
        self.tail = np.full(n_seq_max, -1, dtype=np.int32)  # the last cell apply gave each sequence (kv_blocks)
        self.shift = np.zeros(n_ctx, dtype=np.int32)
        self.has_shift = False
        self.version = 0
        self.changes = 0  # counts every change of the cells: a step readied against them checks it
        # a seq_cp gave cells a second sequence since the cache was cleared (they may be shared): a decode step of
        # many sequences then reads a shared prefix once for all of them where it can (GraphParams.shared)
        self.copied = False
        self.pow2_cells = False  # n_kv rounded to a power of two (a session whose masks are made from the cells)
        self._pow2_floor = 0  # the largest n_kv given since the cache was cleared, with pow2_cells
        self._recount()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.contexts.values())

    def bytes_by_backend(self) -> dict[str, int]:
        return {name: c.nbytes for name, c in self.contexts.items()}

    @property
    def n_used(self) -> int:
        return self._n_used

    def n_free(self) -> int:
        return self.n_ctx - self.n_used

    def n_kv(self, ahead: int = 0, bucket: bool = False) -> int:
        """Cells the attention reads: up to the last used cell, padded so shapes stay stable; with
        `pow2_cells`, to a power of two of the cells in use once `ahead` more tokens (the batch's later
        micro-batches) are placed too, so a graph serves while the cache doubles: every micro-batch of a
        batch of many sequences' prompts, and decode steps whose sequences take new blocks, keep one graph
        (attention lists the tiles it sees, so cells past the last used cost little). Nor does it shrink when
        sequences leave, until the cache is cleared: a session of many sequences whose cells come and go would
        otherwise build its graphs again at every smaller power of two (a new graph costs ~100 ms of host
        work on a GPU, a step of 64 sequences ~5 ms). A decode step of several sequences (`bucket`, buckets.py)
        reads at least BUCKET_FLOOR cells then: its attention lists the tiles each token sees, so the powers of two
        below would only cost graphs (~40 ms of host work each on the H200's Xeon). Prompts are left below it
        (their attention scans the mask of every cell: with every micro-batch at 16384 cells, bench --batched's
        prompts at B = 16 ran at 0.91x llama.cpp's S_PP, 2.27x before), and one token's attention reads every
        cell: their floor is their own (not raised by this)."""
        n = max(self.pad, -(-self._top // self.pad) * self.pad)
        if self.pow2_cells:  # and never below what it was since the cache was cleared (_pow2_floor)
            n = self._pow2_floor = max(1 << (max(n, self._top + ahead) - 1).bit_length(), self._pow2_floor)
            if bucket:
                n = max(n, BUCKET_FLOOR)
        return min(self.n_ctx, n)

    def fill_cell_seqs(self, out: np.ndarray) -> None:
        """out i32 [cells, words]: the first cells' sequences as bits, sequence s as bit s % 32 of word s // 32
        (what ops.kq_mask reads). Only the cells whose sequences changed since the last fill are packed again:
        packing every cell's flags took a decode step of 128 sequences over 32k cells ~1 ms of host time,
        while the GPU waited."""
        n, nbytes = out.shape[0], out.shape[1] * 4
        if nbytes < self._bits.shape[1]:
            raise ValueError(f"{out.shape[1]} words a cell cannot hold {self.n_seq_max} sequences")
        stale = np.flatnonzero(self._stale[:n])
        if len(stale):
            packed = np.packbits(self.seqs[stale], axis=1, bitorder="little")
            self._bits[stale, :packed.shape[1]] = packed
            self._stale[stale] = False
        raw = out.view(np.uint8).reshape(n, nbytes)
        raw[:, :self._bits.shape[1]] = self._bits[:n]
        raw[:, self._bits.shape[1]:] = 0

    def _touch(self, cells) -> None:
        """Mark cells (indices or a mask) whose sequences changed, for fill_cell_seqs to pack again."""
        self._stale[cells] = True

    def _recount(self, freed: bool = False) -> None:
        """Count the used cells and find the highest one again, after cells were freed or moved; `freed`: cells
        were only freed, so none from the top on is used and only those below it are looked at."""
        pos = self.pos[:self._top] if freed else self.pos
        used = np.flatnonzero(pos >= 0)
        self._n_used = len(used)
        self._top = int(used[-1]) + 1 if len(used) else 0
        self._max_pos = int(pos.max()) if len(pos) else -1  # free cells hold negative positions

    def _packed(self) -> bool:
        """Whether the used cells are exactly 0..top-1 (tokens placed in order, none freed below the
        top), so that every cell from top on is free."""
        return self._n_used == self._top

    def evict_unseen(self, pos: np.ndarray, seq: np.ndarray) -> None:
        """Sliding window: free what no token of this micro-batch, nor any later one, can see: a
        sequence's cells at least `window` positions before its first token here."""
        if self.window is None:
            return
        firsts = _first_positions(pos, seq)
        if firsts:  # before any cell changes: a bad id is refused, not taken as an index
            self._check_seq_ids(firsts[0][0], firsts[-1][0])
        for s, first in firsts:
            self._evict(s, first - self.window)

    def _evict(self, seq: int, last: int) -> None:
        """Remove sequence `seq` from its cells at positions up to `last`; free those left empty. Works
        on the few cells concerned (a decode step evicts one), found below the top."""
        if last < 0:
            return
        held = self.seqs[:, seq]
        cells = (self.pos[:self._top] <= last).nonzero()[0]
        if not self._packed():  # free cells (negative positions) lie below the top too
            cells = cells[self.pos[cells] >= 0]
        if not self._holds_every_used(seq):
            cells = cells[held[cells]]
        if not len(cells):
            return
        self.changes += 1
        held[cells] = False
        self._touch(cells)
        # one sequence: every cell it leaves is empty, no need to look at the others
        emptied = cells if self.n_seq_max == 1 else cells[~self.seqs[cells].any(axis=1)]
        if len(emptied):
            self.pos[emptied] = -1
            self.shift[emptied] = 0
            self._n_used -= len(emptied)
            if emptied[-1] + 1 == self._top:  # the highest used cell went: find the new top
                self._recount()

    def find_slot(self, n_tokens: int, seq: np.ndarray | None = None) -> np.ndarray | None:
        """Free cells for n_tokens tokens, or None when the cache cannot hold them. A cache of several
        sequences, given the tokens' sequences, keeps each sequence in blocks of its own (kv_blocks.py);
        otherwise the lowest free cells, without a scan while the cells are packed (the usual case: one
        sequence decoding)."""
        if seq is not None and self.n_seq_max > 1:
            return find_cells(self.pos, self.seqs, self.tail, seq)
        if self._packed():
            if self._top + n_tokens > self.n_ctx:
                return None
            return np.arange(self._top, self._top + n_tokens, dtype=np.int32)
        if self.n_free() < n_tokens:
            return None
        free = self.pos < 0
        if n_tokens == 1:  # a decode step (a window cache's is rarely packed): the first, without listing all
            return np.array([free.argmax()], dtype=np.int32)
        return free.nonzero()[0][:n_tokens].astype(np.int32)

    def spare_cell(self) -> int:
        """The highest free cell (where padding rows write, buckets.py), or -1 when none is free."""
        if self._top < self.n_ctx:
            return self.n_ctx - 1
        back = int(np.argmax(self.pos[::-1] < 0))
        cell = self.n_ctx - 1 - back
        return cell if self.pos[cell] < 0 else -1

    def apply(self, cells: np.ndarray, pos: np.ndarray, seq: np.ndarray, free: bool = False) -> None:
        """Record that `cells` now hold tokens at `pos` of sequences `seq`. `free`: the cells are known to be free
        and distinct and the positions not negative (find_slot's cells for a step readied ahead, the cache unchanged
        since), so the checks that would find it out (~25 us of a decode step's host time at 64 tokens) are skipped."""
        if len(cells) == 1:
            self.apply_one(int(cells[0]), int(pos[0]), int(seq[0]))
            return
        self.changes += 1
        if seq.size:
            self._check_seq_ids(int(seq.min()), int(seq.max()))
        appended = not free and self._packed() and _is_range(cells, self._top) and pos.min() >= 0
        were_free = free or appended or (pos.min() >= 0 and cells.min() >= 0 and bool((self.pos[cells] < 0).all())
                                         and len(np.unique(cells)) == len(cells))
        self.pos[cells] = pos
        self.seqs[cells] = False
        self.seqs[cells, seq] = True
        self._touch(cells)
        self.tail[seq] = cells
        if appended:  # the cells just past the top: still packed, n more used
            self._n_used = self._top = self._top + len(cells)
            self._max_pos = max(self._max_pos, int(pos.max()))
        elif were_free:  # free cells taken (find_slot's): counted without a scan
            self._n_used += len(cells)
            self._top = max(self._top, int(cells.max()) + 1)
            self._max_pos = max(self._max_pos, int(pos.max()))
        else:
            self._recount()

    def apply_one(self, cell: int, pos: int, seq: int) -> None:
        """apply for one token (a decode step), given as numbers: scalar writes, and the counts kept without
        a scan."""
        self.changes += 1
        self._check_seq_ids(seq, seq)
        was_used = self.pos[cell] >= 0
        self.pos[cell] = pos
        if self.n_seq_max > 1:  # with one sequence, the flag set next is the cell's only one
            self.seqs[cell] = False
        self.seqs[cell, seq] = True
        self._touch(cell)
        self.tail[seq] = cell
        if pos < 0 or cell < 0:  # a cell freed by its position, or counted from the end: count again
            self._recount()
            return
        self._n_used += not was_used
        self._top = max(self._top, cell + 1)
        self._max_pos = max(self._max_pos, pos)

    @contextmanager
    def trial(self, cells: np.ndarray, pos: np.ndarray, seq: np.ndarray) -> Iterator[None]:
        """The cells as if apply(cells, pos, seq) had run, and as they were again on leaving (what a
        readied step's inputs are filled from, before the step is known to come)."""
        saved = (self.pos[cells], self.seqs[cells], self._n_used, self._top, self._max_pos, self.changes)
        tail = self.tail.copy()
        self.apply(cells, pos, seq)
        try:
            yield
        finally:
            self.pos[cells], self.seqs[cells] = saved[0], saved[1]
            self._touch(cells)
            self._n_used, self._top, self._max_pos, self.changes = saved[2:]
            self.tail[:] = tail

    def _check_seq_ids(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self.n_seq_max:
            raise BadInput(f"sequence id out of range 0..{self.n_seq_max - 1}")

    def fill_mask(self, out: np.ndarray, pos: np.ndarray, seq: np.ndarray, window: int | None = None) -> None:
        """KQ mask [tokens, n_kv] (f16): 0 where a token may see a cell (same sequence, not later, and
        with a window, fewer than `window` positions back), else -inf."""
        if len(pos) == 1:
            out.fill(-np.inf)
            self._open_row(out[0], int(pos[0]), int(seq[0]), window)
            return
        # the hidden cells as flags, made in place, then written as f16 bits (-inf is 0xfc00, 0 is 0) in one
        # pass: a boolean-indexed store of zeros over an all -inf mask took 2-3x as long (64 and 128 sequences'
        # decode steps over 256 cells each)
        n_kv = out.shape[1]
        cell_pos = self.pos[None, :n_kv]
        hidden = np.logical_not(self.seqs[:n_kv, seq].T, order="C")
        if self._max_pos > int(pos.min()):  # else no cell is later than any token (a decode step in step)
            hidden |= cell_pos > pos[:, None]
        hidden |= cell_pos < 0
        if window is not None:
            hidden |= pos[:, None] - cell_pos >= window
        np.multiply(hidden, np.uint16(0xFC00), out=out.view(np.uint16))

    def _open_row(self, row: np.ndarray, pos: int, seq: int, window: int | None) -> None:
        """Open one token's row of the mask (a decode step): the slice 0..top when the token sees exactly
        those cells, else the cells whose position lies from the lowest one it sees (the window's first,
        or 0, which leaves out free cells) up to its own. Each condition of the formula is a comparison
        with a number, and those that hold for every used cell are not made: none later than the token
        (the bound on positions says so), all of its sequence (_holds_every_used)."""
        if self._sees_all(pos, seq, window):
            row[:self._top] = 0
            return
        cell_pos = self.pos[:row.shape[0]]
        visible = cell_pos >= (0 if window is None else max(0, pos - window + 1))
        if self._max_pos > pos:
            visible &= cell_pos <= pos
        if not self._holds_every_used(seq):
            visible &= self.seqs[:row.shape[0], seq]
        row[visible] = 0

    def _sees_all(self, pos: int, seq: int, window: int | None) -> bool:
        """Whether a token of `seq` at `pos` sees exactly the cells 0..top-1 (the usual decode step: the
        cache packed with its sequence's earlier tokens), which a slice of its mask then opens."""
        if not self._top or not self._packed():
            return False
        used = slice(0, self._top)
        first = 0 if window is None else pos - window + 1  # the first position the window shows
        return (self._max_pos <= pos
                and (self._holds_every_used(seq) or np.count_nonzero(self.seqs[used, seq]) == self._top)
                and (first <= 0 or self.pos[used].min() >= first))

    def _holds_every_used(self, seq: int) -> bool:
        """Whether every used cell holds sequence `seq`, known without looking at them: so with one
        sequence, since a used cell always holds a sequence (apply flags one, and whatever clears a
        cell's last flag frees it)."""
        return self.n_seq_max == 1 and seq == 0

    def _cells(self, seq: int, p0: int, p1: int) -> np.ndarray:
        """The indices of the cells of sequence `seq` (every sequence's where seq < 0) with p0 <= pos < p1; only
        cells below the highest used one are looked at (every cell from _top on is free): at -c 32768 a look at
        every cell cost each seq_rm and seq_cp ~0.1 ms, of which `parallel` makes ~3 per sequence joining."""
        top = self._top
        pos = self.pos[:top]
        p1 = np.iinfo(np.int32).max if p1 < 0 else p1
        in_range = (pos >= max(p0, 0)) & (pos < p1)
        sel = self.seqs[:top, seq] if seq >= 0 else pos >= 0
        return np.flatnonzero(sel & in_range)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove sequence `seq` (all when seq < 0) from cells with p0 <= pos < p1; free emptied cells."""
        sel = self._cells(seq, p0, p1)
        if not len(sel):
            return
        self.changes += 1
        if seq < 0:
            self.seqs[sel] = False
        else:
            self.seqs[sel, seq] = False
        self._touch(sel)
        # only the cells it left can have emptied: looking at every cell's flags took ~1 ms at 32k cells
        emptied = sel[~self.seqs[sel].any(axis=1)]
        if len(emptied):  # counted as _evict counts: a scan only where the top cell went (_max_pos stays a bound)
            self.pos[emptied] = -1
            self.shift[emptied] = 0
            self._n_used -= len(emptied)
            if emptied[-1] + 1 == self._top:
                self._recount(freed=True)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Let sequence dst share src's cells in [p0, p1): no data moves."""
        self.changes += 1
        sel = self._cells(src, p0, p1)
        self.seqs[sel, dst] = True
        self._touch(sel)
        self.copied = self.copied or (src != dst and len(sel) > 0)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions of seq's cells in [p0, p1) by delta; K is re-rotated before the next use."""
        sel = self._cells(seq, p0, p1)
        if not len(sel) or delta == 0:
            return
        self.changes += 1
        self.pos[sel] += delta
        self.shift[sel] += delta
        gone = sel[self.pos[sel] < 0]
        self.pos[gone] = -1
        self.seqs[gone] = False
        self._touch(gone)
        self._recount()
        self.has_shift = True
        self.version += 1

    def clear(self) -> None:
        self.changes += 1
        self.copied = False
        self._pow2_floor = 0
        self.tail[:] = -1
        self.pos[:] = -1
        self.seqs[:] = False
        self._stale[:] = True
        self.shift[:] = 0
        self.has_shift = False
        self._recount()


def _first_positions(pos: np.ndarray, seq: np.ndarray) -> list[tuple[int, int]]:
    """Each sequence of a micro-batch with its first (lowest) position there, in order of sequence id (the
    first pair has the lowest, the last the highest); one token: no array work."""
    if len(seq) == 1:
        return [(int(seq[0]), int(pos[0]))]
    return [(int(s), int(pos[seq == s].min())) for s in np.unique(seq)]


def _is_range(cells: np.ndarray, start: int) -> bool:
    """Whether `cells` are start, start + 1, ... in that order (one cell: a single comparison)."""
    if not len(cells) or cells[0] != start:
        return False
    return len(cells) == 1 or bool((np.diff(cells) == 1).all())
