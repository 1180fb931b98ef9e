"""Graph inputs: small objects that own one input tensor each, fill it from a micro-batch
(`set_input`) and say whether a kept graph's tensor can serve the next one (`can_reuse`).

Inputs live on the CPU (as in llama.cpp); the scheduler copies them to other backends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggrun.core import ops
from ggrun.core.backends.base import Backend
from ggrun.core.dtypes import DType
from ggrun.core.llm.batch import UBatch
from ggrun.core.tensor import Tensor, new_tensor


@dataclass(frozen=True)
class GraphParams:
    """What fixes a graph's shapes: tokens in the micro-batch, rows of logits, cells attended, and whether
    the graph ends in greedy sampling (the logits' argmax, so that only token ids travel back)."""

    n_tokens: int
    n_outputs: int
    n_kv: int
    n_kv_swa: int = 0  # cells attended in the sliding-window cache (iSWA), 0 without one
    greedy: bool = False
    sampler: tuple[int, int] = ()  # the graph ends in ops.sample: (recent tokens, bias entries) per row
    one_per_seq: bool = False  # a decode step of many sequences, a token each: attention per token (buckets.py)
    n_probs: int = -1  # with a sampler: the likeliest tokens ops.sample_logprobs reports per row (-1: no log-probabilities)
    # one_per_seq where the sequences may share cells (KVCache.copied): attention reads a prefix of cells that half
    # the step's tokens or more see whole once for all of them (a backend may: CUDA's cascade, attention.cu)
    shared: bool = False

    def differences(self, other: "GraphParams") -> list[str]:
        return [f"{k} {getattr(other, k)} -> {getattr(self, k)}"
                for k in ("n_tokens", "n_outputs", "n_kv", "n_kv_swa", "greedy", "sampler", "one_per_seq", "n_probs",
                          "shared")
                if getattr(self, k) != getattr(other, k)]


@dataclass
class UBatchState:
    """What inputs read besides the micro-batch: the cells it was given in the cache and in the
    sliding-window cache (when the model has one), and the caches."""

    ub: UBatch
    cells: np.ndarray
    kv: object
    cells_swa: np.ndarray | None = None
    kv_swa: object = None
    sampling: object = None  # the rows' sampling inputs (batched_sampler.SamplingRows) when the graph samples


class GraphInput:
    """One input tensor of a graph."""

    tensor: Tensor

    def set_input(self, st: UBatchState, arr: np.ndarray) -> None:
        raise NotImplementedError

    def can_reuse(self, p: GraphParams) -> bool:
        return True


def _input(name: str, dtype: DType, shape: tuple[int, ...]) -> Tensor:
    return new_tensor(name, dtype, shape, is_input=True)


class InpPerToken(GraphInput):
    """An i32 vector with one value per token of the micro-batch: its token ids, positions, or
    the cache rows its K and V are written to (set_rows indices)."""

    def __init__(self, p: GraphParams, name: str, values: Callable[[UBatchState], np.ndarray]) -> None:
        self.tensor = _input(name, DType.I32, (p.n_tokens,))
        self.values = values

    def set_input(self, st, arr):
        arr[...] = self.values(st)

    def can_reuse(self, p):
        return self.tensor.shape == (p.n_tokens,)


class InpKQMask(GraphInput):
    """Which cells each token may attend to: 0 or -inf, f16 as in llama.cpp. With a window,
    cells more than `window` positions back are hidden too (sliding-window attention); with
    `own_cache` the window's layers have a cache of their own (iSWA) and the mask covers it."""

    def __init__(self, p: GraphParams, window: int | None = None, own_cache: bool = False) -> None:
        self.window = window
        self.own_cache = own_cache
        name = "inp_kq_mask" if window is None else "inp_kq_mask_swa"
        self.tensor = _input(name, DType.F16, self._shape(p))

    def _shape(self, p: GraphParams) -> tuple[int, int]:
        return (p.n_tokens, p.n_kv_swa if self.own_cache else p.n_kv)

    def set_input(self, st, arr):
        kv = st.kv_swa if self.own_cache else st.kv
        ub = st.ub
        if not ub.n_pad:
            kv.fill_mask(arr, ub.pos, ub.seq, self.window)
            return
        n = ub.n_real
        kv.fill_mask(arr[:n], ub.pos[:n], ub.seq[:n], self.window)
        arr[n:] = -np.inf  # padding rows (buckets.py) see cell 0 only
        arr[n:, 0] = 0

    def can_reuse(self, p):
        return self.tensor.shape == self._shape(p)


class InpCellPos(GraphInput):
    """Each cell's position (-1 free) in the cache attention reads, or in the sliding-window cache with
    `own_cache` (what ops.kq_mask builds the mask from)."""

    def __init__(self, p: GraphParams, own_cache: bool = False) -> None:
        self.own_cache = own_cache
        self.tensor = _input("inp_cell_pos_swa" if own_cache else "inp_cell_pos", DType.I32, (_cells(p, own_cache),))

    def set_input(self, st, arr):
        kv = st.kv_swa if self.own_cache else st.kv
        arr[...] = kv.pos[:len(arr)]

    def can_reuse(self, p):
        return self.tensor.shape == (_cells(p, self.own_cache),)


class InpCellSeqs(GraphInput):
    """Each cell's sequences as bits, `words` i32 a cell (KVCache.fill_cell_seqs; ops.kq_mask reads them)."""

    def __init__(self, p: GraphParams, words: int, own_cache: bool = False) -> None:
        self.own_cache = own_cache
        name = "inp_cell_seqs_swa" if own_cache else "inp_cell_seqs"
        self.tensor = _input(name, DType.I32, (_cells(p, own_cache), words))

    def set_input(self, st, arr):
        (st.kv_swa if self.own_cache else st.kv).fill_cell_seqs(arr)

    def can_reuse(self, p):
        return self.tensor.shape[0] == _cells(p, self.own_cache)


def _cells(p: GraphParams, own_cache: bool) -> int:
    """Cells attended in the cache (or, with own_cache, in the sliding-window cache) for params p."""
    return p.n_kv_swa if own_cache else p.n_kv


class KQMaskFromCells:
    """The KQ mask made where attention runs (ops.kq_mask) from the cells' positions and sequence bits and
    the tokens' positions and sequences, in place of a host-filled InpKQMask: for a step of many sequences
    the host sends a few bytes a cell instead of filling tokens x cells. Like InpKQMask, `tensor` is what
    attention reads (`on` gives the one made on a layer's own backend); its own inputs are `inputs`."""

    def __init__(self, p: GraphParams, tok_pos: Tensor, tok_seq: Tensor, words: int, window: int | None = None,
                 own_cache: bool = False) -> None:
        self.inputs = [InpCellPos(p, own_cache), InpCellSeqs(p, words, own_cache)]
        self.name = "kq_mask" if window is None else "kq_mask_swa"
        self._srcs = (self.inputs[0].tensor, self.inputs[1].tensor, tok_pos, tok_seq)
        self.window = window
        self.tensor = ops.kq_mask(*self._srcs, window, name=self.name)
        self._on: dict[str, Tensor] = {}

    def on(self, backend: Backend | None) -> Tensor:
        """The mask made on `backend` (a layer's, where its attention reads it; None: wherever the scheduler
        puts it), one node per backend: made on one device and read on others, it would cross between them at
        every step, and a pipelined prompt's device could make the next micro-batch's mask over it before a
        later device has copied it. Its inputs, a few bytes a cell, go to each device instead."""
        if backend is None:
            return self.tensor
        t = self._on.get(backend.name)
        if t is None:
            t = self._on[backend.name] = ops.kq_mask(*self._srcs, self.window, name=f"{self.name}-{backend.name}")
            t.params[ops.RUN_ON] = backend.name
        return t


def _token_seqs(st: UBatchState) -> np.ndarray:
    """Each token's sequence, -1 for a padding row (buckets.py), which ops.kq_mask shows cell 0 only."""
    ub = st.ub
    if not ub.n_pad:
        return ub.seq
    seq = np.array(ub.seq, dtype=np.int32)
    seq[ub.n_real:] = -1
    return seq


class InpOutIds(GraphInput):
    """Rows of the micro-batch whose logits are computed."""

    def __init__(self, p: GraphParams) -> None:
        self.tensor = _input("inp_out_ids", DType.I32, (p.n_outputs,))

    def set_input(self, st, arr):
        arr[...] = st.ub.out_rows

    def can_reuse(self, p):
        return self.tensor.shape == (p.n_outputs,)


class InpSamplingRows(GraphInput):
    """One of ops.sample's per-row inputs (a field of batched_sampler.SamplingRows, [rows, cols]); rows past
    the micro-batch's outputs (padding) get `neutral`, which samples greedily."""

    def __init__(self, p: GraphParams, field: str, dtype: DType, cols: int, neutral) -> None:
        self.tensor = _input(f"inp_sample_{field}", dtype, (p.n_outputs, cols))
        self.field = field
        self.neutral = neutral

    def set_input(self, st, arr):
        rows = getattr(st.sampling, self.field)
        n = len(rows)
        arr[:n] = rows
        arr[n:] = self.neutral

    def can_reuse(self, p):
        return self.tensor.shape[0] == p.n_outputs


NEUTRAL_SAMPLING = (0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0)  # temperature 0: the argmax, no penalty


def sampling_inputs(p: GraphParams) -> list[InpSamplingRows]:
    """ops.sample's inputs after the logits: parameters, draws, recent tokens, bias ids and values."""
    n_recent, n_bias = p.sampler
    return [InpSamplingRows(p, "params", DType.F32, len(NEUTRAL_SAMPLING), np.array(NEUTRAL_SAMPLING, np.float32)),
            InpSamplingRows(p, "draws", DType.I32, 2, 0),
            InpSamplingRows(p, "recent", DType.I32, n_recent, -1),
            InpSamplingRows(p, "bias_ids", DType.I32, n_bias, -1),
            InpSamplingRows(p, "bias_vals", DType.F32, n_bias, 0.0)]


class InpKShift(GraphInput):
    """Per-cell position deltas for re-rotating cached keys after a position shift."""

    def __init__(self, n_ctx: int) -> None:
        self.tensor = _input("inp_k_shift", DType.I32, (n_ctx,))

    def set_input(self, st, arr):
        arr[...] = st.kv.shift


@dataclass
class GraphInputs:
    """The inputs of a decode graph; out_ids is None when every token needs logits."""

    tokens: InpPerToken
    pos: InpPerToken
    kv_idx: InpPerToken
    kq_mask: InpKQMask | KQMaskFromCells
    out_ids: InpOutIds | None
    kq_mask_swa: InpKQMask | KQMaskFromCells | None = None
    kv_idx_swa: InpPerToken | None = None  # rows of the sliding-window cache (iSWA), when there is one
    sampling: list[InpSamplingRows] | None = None  # ops.sample's inputs, when the graph samples
    seq: InpPerToken | None = None  # each token's sequence, when the masks are made from the cells

    @staticmethod
    def for_params(p: GraphParams, swa_window: int | None = None, seq_words: int = 0) -> "GraphInputs":
        """The inputs of a graph for p; with seq_words (the cache's i32 words of sequence bits a cell), masks
        made where attention runs from the cells (KQMaskFromCells) instead of filled on the host."""
        own = p.n_kv_swa > 0
        pos = InpPerToken(p, "inp_pos", lambda st: st.ub.pos)
        seq = InpPerToken(p, "inp_seq", _token_seqs) if seq_words else None
        if seq is not None:
            mask = KQMaskFromCells(p, pos.tensor, seq.tensor, seq_words)
            mask_swa = KQMaskFromCells(p, pos.tensor, seq.tensor, seq_words, swa_window, own) if swa_window else None
        else:
            mask = InpKQMask(p)
            mask_swa = InpKQMask(p, swa_window, own) if swa_window else None
        return GraphInputs(InpPerToken(p, "inp_tokens", lambda st: st.ub.tokens), pos,
                           InpPerToken(p, "inp_kv_idx", lambda st: st.cells),
                           mask,
                           InpOutIds(p) if p.n_outputs < p.n_tokens else None,
                           mask_swa,
                           InpPerToken(p, "inp_kv_idx_swa", lambda st: st.cells_swa) if own else None,
                           sampling_inputs(p) if p.sampler else None, seq)

    def mask_on(self, mask: Tensor, backend: Backend | None) -> Tensor:
        """The mask attention on `backend` reads for `mask` (the tensor of kq_mask or kq_mask_swa): a mask made
        from the cells is made on that backend (KQMaskFromCells.on); a host-filled one is itself."""
        for m in (self.kq_mask, self.kq_mask_swa):
            if isinstance(m, KQMaskFromCells) and m.tensor is mask:
                return m.on(backend)
        return mask

    def all(self) -> list[GraphInput]:
        out: list[GraphInput] = []
        for i in (self.tokens, self.pos, self.kv_idx, self.kq_mask, self.out_ids, self.kq_mask_swa,
                  self.kv_idx_swa, self.seq):
            if isinstance(i, KQMaskFromCells):
                out += i.inputs
            elif i is not None:
                out.append(i)
        return out + (self.sampling or [])
