"""The gemma3 graph on a synthetic tiny model (ggrun.loaders.synthetic.write_tiny_gemma3: 7 layers, so sliding-window
layers 0-4 and 6 and global layer 5 both appear; head_dim 32 != n_embd / n_head; window 8) against an
independent float64 numpy forward pass (tests/llm/gemma3_reference.py).

The exact comparisons use f32 numerics and an f32 KV cache, where ggrun and the reference differ only by
f32 rounding (measured max |diff| ~3e-6 on logits of scale ~1); the 20-token prompt is longer than the
window, so positions 8.. see only part of the sequence on the sliding-window layers."""
from __future__ import annotations

import math

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.dtypes import DType
from ggrun.core.llm.archs import ARCHS
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.generate import generate
from ggrun.core.llm.kv_cache import KVCache
from ggrun.core.llm.model import Model
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.synthetic import bytes_to_unicode, tiny_bpe_vocab, write_tiny_gemma3, written_once
from tests.cli.runner import ggrun
from tests.llm.gemma3_reference import ReferenceGemma3

# 20 token ids spread over the tiny vocabulary (bytes, merges, the control token).
PROMPT = [104, 101, 108, 108, 111, 256, 263, 32, 119, 275, 10, 66, 200, 7, 268, 258, 111, 33, 120, 99]
WINDOW = 8  # write_tiny_gemma3's default sliding window
ATOL = 1e-3


@pytest.fixture(scope="module")
def gemma_factory(tmp_path_factory):
    """write(**options) -> path of a tiny gemma3 written once per distinct set of options."""
    return written_once(write_tiny_gemma3, tmp_path_factory.mktemp, "tiny_gemma3")


@pytest.fixture(scope="module")
def gemma_path(gemma_factory):
    return gemma_factory()


@pytest.fixture(scope="module")
def model(gemma_path) -> Model:
    """The tiny gemma3 with plain f32 arithmetic."""
    return Model.load(gemma_path, [CPUBackend()], numerics="f32")


@pytest.fixture(scope="module")
def ref(gemma_path) -> ReferenceGemma3:
    return ReferenceGemma3.load(gemma_path)


@pytest.fixture(scope="module")
def want(ref) -> np.ndarray:
    """The reference's logits of PROMPT."""
    return ref.logits(PROMPT)


def session(model: Model, n_ctx: int = 64, n_ubatch: int = 512, kv_type: DType = DType.F32,
            graph_reuse: bool = True) -> Session:
    return Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch, type_k=kv_type, type_v=kv_type,
                                        graph_reuse=graph_reuse))


def all_logits(s: Session, tokens: list[int], pos0: int = 0) -> np.ndarray:
    """Logits of every token of sequence 0 at positions pos0.., decoded as one batch."""
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, pos0 + i, 0, True)
    return s.decode(b)


def test_hparams_of_the_tiny_model(model):
    hp = model.hp
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim) == ("gemma3", 7, 64, 4, 1, 32)
    assert hp.head_dim != hp.n_embd // hp.n_head
    assert hp.extra["swa_window"] == WINDOW
    assert hp.extra["attn_scale"] == pytest.approx(1 / math.sqrt(32))
    arch = ARCHS["gemma3"]
    assert [il for il, swa in enumerate(arch.swa_layers(hp)) if not swa] == [5]
    assert [arch.rope_freq_base(hp, il) for il in range(hp.n_layer)] == [1e4] * 5 + [1e6] + [1e4]
    assert "output.weight" not in model.gguf.tensors
    assert model.weights["output.weight"] is model.weights["token_embd.weight"]  # tied head


@pytest.mark.parametrize("weight_type", [QT.F32, QT.F16], ids=lambda t: t.name)
def test_logits_match_reference(gemma_factory, weight_type):
    path = gemma_factory() if weight_type is QT.F32 else gemma_factory(weight_type=weight_type)
    m = Model.load(path, [CPUBackend()], numerics="f32")
    got = all_logits(session(m), PROMPT)
    expected = ReferenceGemma3.load(path).logits(PROMPT)
    assert got.shape == expected.shape == (len(PROMPT), m.hp.n_vocab)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_sliding_window_changes_logits(model, ref, want, monkeypatch):
    """Ignoring the window leaves positions < 8 alone (they see everything either way) and moves later ones
    by over a logit (measured >= 1.2): the reference without the window is far from ggrun, and ggrun with
    its mask made window-blind equals that reference."""
    no_window = ref.logits(PROMPT, window=False)
    early, late = slice(0, WINDOW), slice(WINDOW, None)
    np.testing.assert_allclose(no_window[early], want[early], atol=1e-9, rtol=0)
    assert np.abs(no_window[late] - want[late]).max(axis=-1).min() > 0.5

    got = all_logits(session(model), PROMPT)
    assert np.abs(got[late] - no_window[late]).max(axis=-1).min() > 0.5

    fill_mask = KVCache.fill_mask
    monkeypatch.setattr(KVCache, "fill_mask", lambda self, out, pos, seq, window=None: fill_mask(self, out, pos, seq))
    blind = all_logits(session(model), PROMPT)
    np.testing.assert_allclose(blind, no_window, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_ubatch", [1, 5, 32])
def test_micro_batch_size_does_not_change_logits(model, want, n_ubatch):
    """-ub 1 and 5 decode the prompt against the cache (the window then hides cached cells); 32 in one graph."""
    got = all_logits(session(model, n_ubatch=n_ubatch), PROMPT)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"-ub {n_ubatch}")


@pytest.mark.parametrize("n_ubatch", [1, 32])
def test_fused_attention_matches_reference(model, want, n_ubatch):
    """-fa takes the sliding-window mask too."""
    s = Session(model, SessionParams(n_ctx=64, n_batch=64, n_ubatch=n_ubatch, type_k=DType.F32, type_v=DType.F32, flash_attn=True))
    np.testing.assert_allclose(all_logits(s, PROMPT), want, atol=ATOL, rtol=0)


def test_micro_batch_sizes_agree_with_each_other(model):
    by_ub = {ub: all_logits(session(model, n_ubatch=ub), PROMPT) for ub in (1, 5, 32)}
    for ub in (1, 5):
        np.testing.assert_allclose(by_ub[ub], by_ub[32], atol=ATOL, rtol=0, err_msg=f"-ub {ub} vs 32")


def test_graph_reuse_gives_identical_logits(model):
    """Token by token (-ub 1): one graph serves all 20 micro-batches with reuse on, 20 are built with it
    off, and the logits are bitwise the same."""
    on, off = session(model, n_ubatch=1), session(model, n_ubatch=1, graph_reuse=False)
    got_on, got_off = all_logits(on, PROMPT), all_logits(off, PROMPT)
    assert (on.stats.graphs_built, on.stats.graphs_reused) == (1, len(PROMPT) - 1)
    assert (off.stats.graphs_built, off.stats.graphs_reused) == (len(PROMPT), 0)
    np.testing.assert_array_equal(got_on, got_off)


@pytest.mark.parametrize("n_ubatch", [1, 32])
def test_greedy_generation_matches_reference(model, ref, n_ubatch):
    """generate() with temperature 0 picks the reference's argmax at every step, at positions 15..20 where
    the sliding-window layers no longer see the first tokens; decode steps reuse one graph. (A 15-token
    prompt: the tiny random model continues it with 5 distinct tokens, where most prompts settle into
    repeating one.)"""
    prompt, n = PROMPT[:15], 6
    s = session(model, n_ubatch=n_ubatch)
    out, st = generate(s, prompt, n, Sampler(SamplingParams(temp=0)), lambda t: None, ignore_eos=True)
    expected = ref.greedy(prompt, n)
    assert len(set(expected)) == 5
    assert out == expected
    assert (st.n_prompt, st.n_eval) == (len(prompt), n - 1)
    assert s.stats.reuse_log[-(n - 2):] == [(True, "reused")] * (n - 2)


def rotate_neox(x: np.ndarray, delta: int, base: float) -> np.ndarray:
    """Keys [cells, heads, head_dim] rotated by `delta` positions in NEOX mode (halves pair up)."""
    half = x.shape[-1] // 2
    theta = delta * base ** (-np.arange(0, x.shape[-1], 2) / x.shape[-1])
    cos, sin = np.cos(theta), np.sin(theta)
    x0, x1 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)


def test_k_shift_rotates_with_each_layers_base(model):
    """Drop positions 0..3 of 12 cached tokens and move 4..11 down by 4: the K-shift re-rotates each layer's
    keys by -4 with that layer's RoPE base (10000 on sliding-window layers, 1e6 on layer 5); layer 0's keys,
    which depend only on token and position, equal a fresh evaluation's at the new positions. (Deeper
    layers' keys still carry the dropped tokens' influence, so the logits are not a fresh evaluation's.)"""
    hp = model.hp
    s = session(model)
    all_logits(s, PROMPT[:12])
    cpu = s.sched.cpu
    shape = (s.kv.n_ctx, hp.n_head_kv, hp.head_dim)
    layers = [{**s.kv.layers, **s.kv_swa.layers}[il] for il in range(hp.n_layer)]  # both caches: iSWA
    assert s.kv_swa.n_ctx == s.kv.n_ctx  # the window cache is padded to 256 cells, capped by the context
    before = [cpu.array(L.k).reshape(shape)[4:12].copy() for L in layers]
    s.seq_rm(0, 0, 4)
    s.seq_add(0, 4, -1, -4)
    got = all_logits(s, PROMPT[12:14], pos0=8)
    assert np.isfinite(got).all()
    after = [cpu.array(L.k).reshape(shape)[4:12].copy() for L in layers]
    assert s.kv.pos[4:12].tolist() == list(range(8))
    for il in range(hp.n_layer):
        base = 1e4 if il != 5 else 1e6
        np.testing.assert_allclose(after[il], rotate_neox(before[il], -4, base), atol=1e-5, rtol=0,
                                   err_msg=f"layer {il}")
        assert np.abs(after[il] - rotate_neox(before[il], -4, 1e6 if il != 5 else 1e4)).max() > 1e-2
    fresh = session(model)
    all_logits(fresh, PROMPT[4:12])
    fresh_k = fresh.sched.cpu.array(fresh.kv_swa.layers[0].k).reshape(shape)[:8]  # layer 0 is a window layer
    np.testing.assert_allclose(after[0], fresh_k, atol=1e-5, rtol=0)


def test_llama_numerics_end_to_end(gemma_path, want):
    """The default numerics (GELU table, f16 against the default f16 cache) run the whole path: tokens come
    out, logits stay finite and near the exact reference (measured max |diff| ~3e-3)."""
    m = Model.load(gemma_path, [CPUBackend()])
    assert m.numerics == "llama"
    got = all_logits(Session(m, SessionParams(n_ctx=64)), PROMPT)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 2e-2
    out, st = generate(Session(m, SessionParams(n_ctx=64)), PROMPT, 4, Sampler(SamplingParams(temp=0)),
                       lambda t: None, ignore_eos=True)
    assert len(out) == 4 and all(0 <= t < m.hp.n_vocab for t in out)


def test_cli_run(capsys, monkeypatch, tmp_path, gemma_path, ref):
    """`ggrun run` on a gemma3 file: "hi" (echoed) is two byte tokens, and the 3 greedy tokens are the
    reference's (its smallest top-2 margin there is 0.19, far above the default numerics' drift)."""
    path = tmp_path / "tiny_gemma3.gguf"
    path.write_bytes(gemma_path.read_bytes())
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", path, "-p", "hi", "-n", "3", "--temp", "0")
    assert code == 0, err
    assert "Traceback" not in err
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    vocab = tiny_bpe_vocab()[0]
    expected = ref.greedy([ord("h"), ord("i")], 3)
    text = b"".join(bytes(to_byte[c] for c in vocab[t]) for t in expected).decode("utf-8", "replace")
    assert out == "hi" + text + "\n"


def test_window_layers_get_a_cache_of_their_own(model, ref):
    """iSWA: with -c 1024 and -ub 8 the window layers' cache has 256 cells (window 8 + 8 tokens, padded),
    the others' 1024; 300 tokens decoded 8 at a time wrap around the small cache (cells no token can see
    are reused), and every logit still equals the reference's full-attention-with-window forward pass."""
    s = Session(model, SessionParams(n_ctx=1024, n_batch=8, n_ubatch=8, type_k=DType.F32, type_v=DType.F32))
    assert (s.kv.n_ctx, s.kv_swa.n_ctx) == (1024, 256)
    assert sorted(s.kv.layers) == [5] and sorted(s.kv_swa.layers) == [0, 1, 2, 3, 4, 6]
    assert s.kv_bytes_by_backend()["CPU"] == (1024 * 1 + 256 * 6) * 2 * 32 * 4
    tokens = [PROMPT[i % len(PROMPT)] for i in range(300)]
    got = all_logits(s, tokens)
    assert s.kv_swa.n_used <= 256 and s.kv.n_used == 300
    np.testing.assert_allclose(got, ref.logits(tokens), atol=ATOL, rtol=0)


def test_fewer_than_six_layers_are_all_sliding_window(gemma_factory):
    """With 2 layers there is no global layer: nothing reads the global cache's rows or mask, which then get
    no memory, and the session sets only the inputs its graph reads (it used to fail on the unplaced rows)."""
    path = gemma_factory(n_layer=2)
    m = Model.load(path, [CPUBackend()], numerics="f32")
    assert not m.arch.swa_layers(m.hp).count(False)
    s = session(m)
    got = all_logits(s, PROMPT[:12])
    step = s.decode(Batch.of_sequence([PROMPT[12]], 12))
    want = ReferenceGemma3.load(path).logits(PROMPT[:13])
    np.testing.assert_allclose(got, want[:12], atol=ATOL, rtol=0)
    np.testing.assert_allclose(step[0], want[12], atol=ATOL, rtol=0)
