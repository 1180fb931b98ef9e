"""KQ masks made from the cells (inputs.KQMaskFromCells, ops.kq_mask): the mask the reference kernel makes
from the cells' positions and sequence bits is the host-filled one (KVCache.fill_mask), windows and padding
rows included; a session whose masks are made so decodes many sequences, prompts and decode steps, to the
same logits as one that fills them on the host (llama's global attention, gemma3's sliding window), and
with layers split over two devices each makes its own."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.kernels import KERNELS
from ggrun.core.backends.sim import SimBackend
from ggrun.core.dtypes import DType
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.kv_cache import KVCache
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.core.tensor import new_tensor


def _cache(n_ctx: int, n_seq: int, rng) -> KVCache:
    """A cache whose cells hold random positions of random sequences (a few cells shared, some free)."""
    kv = KVCache(n_ctx, 8, [CPUBackend()], n_seq_max=n_seq)
    used = rng.random(n_ctx) < 0.8
    kv.pos[:] = np.where(used, rng.integers(0, 60, n_ctx), -1)
    kv.seqs[:] = False
    kv.seqs[np.flatnonzero(used), rng.integers(0, n_seq, n_ctx)[used]] = True
    shared = np.flatnonzero(used)[::7]
    kv.seqs[shared, (rng.integers(0, n_seq, len(shared)))] = True
    kv._recount()  # the counts and the bound on positions the cache keeps, for the cells written here
    return kv


def _kq_mask(kv: KVCache, n_kv: int, pos: np.ndarray, seq: np.ndarray, window: int | None) -> np.ndarray:
    """ops.kq_mask by the reference kernel over the cache's first n_kv cells."""
    words = -(-kv.n_seq_max // 32)
    cells = (new_tensor("cp", DType.I32, (n_kv,), is_input=True), new_tensor("cs", DType.I32, (n_kv, words), is_input=True))
    toks = (new_tensor("tp", DType.I32, pos.shape, is_input=True), new_tensor("ts", DType.I32, pos.shape, is_input=True))
    node = ops.kq_mask(*cells, *toks, window)
    seqs = np.zeros((n_kv, words), dtype=np.int32)
    kv.fill_cell_seqs(seqs)
    out = np.empty(node.shape, dtype=np.float16)
    KERNELS["kq_mask"](np, node, out, [kv.pos[:n_kv].copy(), seqs, pos, seq])
    return out


@pytest.mark.parametrize("n_seq, window", [(3, None), (40, None), (40, 9), (70, None)])
def test_mask_from_cells_is_the_host_mask(n_seq, window):
    rng = np.random.default_rng(n_seq)
    kv = _cache(256, n_seq, rng)
    pos = rng.integers(0, 64, 24).astype(np.int32)
    seq = rng.integers(0, n_seq, 24).astype(np.int32)
    want = np.empty((24, 256), dtype=np.float16)
    kv.fill_mask(want, pos, seq, window)
    got = _kq_mask(kv, 256, pos, seq, window)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.count_nonzero(got == 0) > 0


def test_padding_rows_see_cell_zero_only():
    kv = _cache(64, 4, np.random.default_rng(1))
    got = _kq_mask(kv, 64, np.array([30, 0], np.int32), np.array([2, -1], np.int32), None)
    assert got[1, 0] == 0 and np.isneginf(got[1, 1:]).all()


def _logits(model: Model, from_cells: bool, n_seq: int = 6) -> list[np.ndarray]:
    """Prompts of n_seq sequences in one batch (two micro-batches), then four decode steps of all of them."""
    s = Session(model, SessionParams(n_ctx=512, n_batch=512, n_ubatch=32, n_seq_max=n_seq,
                                     mask_from_cells=from_cells))
    assert (s.seq_words > 0) == from_cells
    rng = np.random.default_rng(3)
    lens = rng.integers(3, 12, n_seq)
    b = Batch()
    for q, n in enumerate(lens):
        for i, t in enumerate(rng.integers(1, 200, n)):
            b.add(int(t), i, q, i == n - 1)
    out = [s.decode(b).copy()]
    pos = lens.astype(np.int32)
    for _ in range(4):
        step = Batch(rng.integers(1, 200, n_seq).astype(np.int32), pos.copy(), np.arange(n_seq, dtype=np.int32),
                     np.ones(n_seq, dtype=bool))
        out.append(s.decode(step).copy())
        pos += 1
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_session_with_masks_from_the_cells_decodes_as_one_with_host_masks(family, tiny_llama_path,
                                                                            tiny_gemma3_factory):
    path = tiny_llama_path if family == "llama" else tiny_gemma3_factory()
    model = Model.load(path, [CPUBackend()], numerics="f32")
    for got, want in zip(_logits(model, True), _logits(model, False)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_masks_from_the_cells_are_made_on_each_device_of_a_layer_split(family, tiny_llama_factory,
                                                                       tiny_gemma3_factory):
    """Layers split over two stand-in devices (what two GPUs are to the engine): each device makes the masks
    its layers read from the cells, none crosses between them, and the logits are those of host masks."""
    path = tiny_llama_factory(n_layer=4) if family == "llama" else tiny_gemma3_factory()
    model = Model.load(path, [SimBackend(name="SIM0"), SimBackend(name="SIM1"), CPUBackend()], 99, numerics="f32")
    assert {model.placement.layers[0].name, model.placement.layers[-1].name} == {"SIM0", "SIM1"}
    got, want = _logits(model, True), _logits(model, False)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    s = Session(model, SessionParams(n_ctx=512, n_ubatch=32, n_seq_max=6, mask_from_cells=True))
    s.decode(Batch([5, 6], [0, 0], [0, 1], [True, True]))
    sg = s.result.sg
    masks = [n for n in sg.graph.nodes if n.op == "kq_mask"]
    assert all(n.name.endswith("-" + sg.home(n).name) for n in masks)
    assert {sg.home(n).name for n in masks} == {"SIM0", "SIM1"}
    assert not [c for sp in sg.splits for c in sp.copies if c.srcs[0].op == "kq_mask"]
