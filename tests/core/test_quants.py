"""Dequantization against gguf's reference code, against independent packers, and round-trip bounds."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from ggrun.core.quants import SUPPORTED_TYPES, block_layout, dequantize, tensor_nbytes

SMOLLM2 = Path.home() / ".cache/ggrun/models/SmolLM2-135M-Instruct.Q4_1.gguf"

# Types gguf can quantize, with the largest error a block may have relative to its values.
QUANTIZABLE = {
    QT.F16: lambda x: np.abs(x) * 2.0 ** -10,
    QT.BF16: lambda x: np.abs(x) * 2.0 ** -7,
    QT.Q8_0: lambda x: _block_absmax(x) / 127,
    QT.Q4_0: lambda x: _block_absmax(x) / 8,
    QT.Q5_0: lambda x: _block_absmax(x) / 16,
    QT.Q4_1: lambda x: _block_range(x) / 15,
    QT.Q5_1: lambda x: _block_range(x) / 31,
}
K_QUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)
LUT4 = (QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4)  # against ggml itself in test_lut4.py


def _blocks(x: np.ndarray, size: int = 32) -> np.ndarray:
    return x.reshape(-1, size)


def _block_absmax(x: np.ndarray) -> np.ndarray:
    return np.abs(_blocks(x)).max(axis=1, keepdims=True) * np.ones((1, 32))


def _block_range(x: np.ndarray) -> np.ndarray:
    b = _blocks(x)
    return (b.max(axis=1, keepdims=True) - b.min(axis=1, keepdims=True)) * np.ones((1, 32))


def _values(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * rng.uniform(0.01, 2.0, size=(shape[0], 1))).astype(np.float32)


def test_supported_types_are_the_documented_ones():
    assert SUPPORTED_TYPES == set(QUANTIZABLE) | set(K_QUANTS) | set(LUT4) | {QT.F32}


def test_tensor_nbytes():
    assert tensor_nbytes(QT.F32, 10) == 40
    assert tensor_nbytes(QT.Q4_1, 64) == 40
    assert tensor_nbytes(QT.Q6_K, 512) == 420
    with pytest.raises(ValueError):
        tensor_nbytes(QT.Q8_0, 33)


def test_f32_is_a_view_when_aligned_and_correct_when_not():
    x = _values((4, 8))
    buf = np.zeros(x.nbytes + 4, dtype=np.uint8)
    buf[:x.nbytes] = x.view(np.uint8).ravel()
    aligned = dequantize(buf[:x.nbytes], QT.F32, (4, 8))
    assert np.shares_memory(aligned, buf)
    np.testing.assert_array_equal(aligned, x)
    buf[1:x.nbytes + 1] = x.view(np.uint8).ravel()
    unaligned = dequantize(buf[1:x.nbytes + 1], QT.F32, (4, 8))
    np.testing.assert_array_equal(unaligned, x)


@pytest.mark.parametrize("qtype", list(QUANTIZABLE), ids=lambda t: t.name)
def test_matches_gguf_and_round_trips(qtype):
    x = _values((16, 256))
    raw = np.asarray(gguf_quantize(x, qtype)).view(np.uint8)
    ours = dequantize(raw.ravel(), qtype, x.shape)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, gguf_dequantize(raw, qtype).reshape(x.shape))
    bound = QUANTIZABLE[qtype](x).reshape(x.shape)
    assert np.all(np.abs(ours - x) <= bound * 1.001 + 1e-7)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_random_k_blocks_match_gguf(qtype):
    raw = _random_blocks(qtype, n_blocks=64)
    ours = dequantize(raw, qtype, (8, 8 * 256))
    np.testing.assert_array_equal(ours, gguf_dequantize(raw.reshape(8, -1), qtype))


@pytest.mark.parametrize("qtype", (QT.Q4_K, QT.Q5_K, QT.Q6_K), ids=lambda t: t.name)  # K_PACKERS
def test_k_quants_round_trip(qtype):
    x = _values((8, 512))
    raw = K_PACKERS[qtype](x.reshape(-1, 256))
    ours = dequantize(raw.ravel(), qtype, x.shape)
    np.testing.assert_array_equal(ours, gguf_dequantize(raw.reshape(8, -1), qtype))
    # The coarsest step in each 256-block bounds the error: a wrong bit layout would be off by ~all of it.
    levels = 63 if qtype == QT.Q6_K else (15 if qtype == QT.Q4_K else 31)
    blocks = x.reshape(-1, 256)
    spread = blocks.max(axis=1, keepdims=True) - np.minimum(blocks.min(axis=1, keepdims=True), 0)
    assert np.all(np.abs(ours.reshape(-1, 256) - blocks) <= spread / levels)


def test_wrong_byte_count_is_rejected():
    with pytest.raises(ValueError, match="needs 40"):
        dequantize(np.zeros(39, dtype=np.uint8), QT.Q4_1, (64,))


def test_unsupported_type_is_rejected():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(np.zeros(66, dtype=np.uint8), QT.IQ2_XXS, (256,))


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2.exists(), reason="SmolLM2 model not downloaded")
def test_real_model_tensors_match_gguf():
    from ggrun.loaders.gguf_file import open_gguf

    with open_gguf(SMOLLM2) as model:
        for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"]:
            info = model.tensors[name]
            expected = gguf_dequantize(model.raw(name), info.qtype).reshape(info.shape)
            np.testing.assert_array_equal(model.load_f32(name), expected)


# Independent K-quant packers (ggml-common.h block layouts), used for the round trip.

def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


# Byte offsets of each k-quant's f16 super-block scale and (where it has one) f16 min scale.
_K_SCALE_FIELDS = {QT.Q2_K: (80, 82), QT.Q3_K: (108, None), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208, None)}


def _random_blocks(qtype: QT, n_blocks: int, seed: int = 1) -> np.ndarray:
    """Random bytes with every f16 scale field replaced by a small finite value."""
    rng = np.random.default_rng(seed)
    _, type_size = block_layout(qtype)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    d_at, dmin_at = _K_SCALE_FIELDS[qtype]
    blocks[:, d_at:d_at + 2] = _f16_bytes(rng.uniform(-0.1, 0.1, size=n_blocks))
    if dmin_at is not None:
        blocks[:, dmin_at:dmin_at + 2] = _f16_bytes(rng.uniform(0, 0.1, size=n_blocks))
    return blocks.ravel()


def _scale_for(step: np.ndarray, max_int: int) -> tuple[np.ndarray, np.ndarray]:
    """A per-block f16 super-scale and per-sub-block integer multiples of it approximating `step`."""
    d = (step.max(axis=1) / max_int).astype(np.float16).astype(np.float32)
    safe_d = np.where(d == 0, 1, d)[:, None]
    return d, np.clip(np.rint(step / safe_d), 0, max_int)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins into Q4_K/Q5_K's 12 bytes (the inverse of get_scale_min_k4)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1)


def _quantize_k_min(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Asymmetric 8x32 sub-block quantization shared by Q4_K and Q5_K: x ~ d*sc*q - dmin*m."""
    sub = x.reshape(-1, 8, 32)
    offset = -np.minimum(sub.min(axis=2), 0)
    step = (sub.max(axis=2) + offset) / levels
    d, sc = _scale_for(step, 63)
    dmin, mn = _scale_for(offset, 63)
    unit = np.where(sc == 0, 1, d[:, None] * sc)[:, :, None]
    q = np.clip(np.rint((sub + (dmin[:, None] * mn)[:, :, None]) / unit), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def _pack_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _quantize_k_min(x, 15)
    pairs = q.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qs], axis=1)


def _pack_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _quantize_k_min(x, 31)
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).astype(np.uint8)  # (n, 8 sub-blocks, 32): bit s of qh[l] is sub-block s
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, qs], axis=1)


def _pack_q6_k(x: np.ndarray) -> np.ndarray:
    groups = x.reshape(-1, 16, 16)
    d, sc = _scale_for(np.abs(groups).max(axis=2) / 31, 127)
    unit = np.where(sc == 0, 1, d[:, None] * sc)[:, :, None]
    q = (np.clip(np.rint(groups / unit), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


K_PACKERS = {QT.Q4_K: _pack_q4_k, QT.Q5_K: _pack_q5_k, QT.Q6_K: _pack_q6_k}
