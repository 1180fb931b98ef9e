"""The quant tables: GGUF block layouts, their numpy decoders to float32 (the reference that
every backend's compiled kernels are tested against), shared by the loader and the engine, and
encoders for the block types a KV cache stores (Q8_0, Q4_0, rounded as ggml's CPU does).

Pure vectorized numpy over whole tensors; it never loops over blocks in Python and never copies F32
data that can be viewed in place.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

SUPPORTED_TYPES: frozenset[QT] = frozenset({
    QT.F32, QT.F16, QT.BF16,
    QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
    QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4,
})

# ggml's kvalues_iq4nl (IQ4_NL, IQ4_XS) and kvalues_mxfp4 (MXFP4: twice the E2M1 values, so that the
# block's E8M0 scale is read as half of 2^(e - 127)): the 16 values a 4-bit index stands for.
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)

# Blocks are decoded this many at a time so that the temporaries stay in cache.
_CHUNK_BLOCKS = 1 << 14

# One numpy record per quant block, following ggml's block_* structs (ggml-common.h).
_BLOCK_DTYPES: dict[QT, np.dtype] = {
    QT.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    QT.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    QT.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    QT.Q5_0: np.dtype([("d", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)]),
    QT.Q5_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)]),
    QT.Q2_K: np.dtype([("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2"), ("dmin", "<f2")]),
    QT.Q3_K: np.dtype([("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2")]),
    QT.Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)]),
    QT.Q5_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32),
                       ("qs", "u1", 128)]),
    QT.Q6_K: np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")]),
    QT.IQ4_NL: np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    QT.IQ4_XS: np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", 4), ("qs", "u1", 128)]),
    QT.MXFP4: np.dtype([("e", "u1"), ("qs", "u1", 16)]),
}


def vec_dot_blocks(qtype) -> str:
    """The 8-bit activation blocks ggml's CPU vec_dot of a block-quantized weight type reads
    (`act_quant`): "q8_k" for the k-quants and IQ4_XS (256-value super-blocks), "q8_0" for the rest."""
    name = qtype if isinstance(qtype, str) else QT(qtype).name
    return "q8_k" if name.endswith("_K") or name == "IQ4_XS" else "q8_0"


def block_layout(qtype: QT) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type."""
    return GGML_QUANT_SIZES[qtype]


def tensor_nbytes(qtype: QT, n_elements: int) -> int:
    """Bytes that `n_elements` values of `qtype` occupy; ValueError if they do not fill whole blocks."""
    block_size, type_size = block_layout(qtype)
    if n_elements % block_size:
        raise ValueError(f"{n_elements} elements are not a whole number of {qtype.name} blocks of {block_size}")
    return n_elements // block_size * type_size


def dequantize(raw: np.ndarray, qtype: QT, shape: tuple[int, ...]) -> np.ndarray:
    """Decode `raw` (uint8 bytes of one tensor) into a float32 array of `shape` (numpy order).

    F32 data comes back as a view of `raw` when it is 4-byte aligned; everything else is a new array.
    """
    qtype = QT[qtype] if isinstance(qtype, str) else QT(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    n_elements = int(np.prod(shape, dtype=np.int64))
    expected = tensor_nbytes(qtype, n_elements)
    raw = np.asarray(raw).reshape(-1)
    if raw.dtype != np.uint8 or raw.size != expected:
        raise ValueError(f"{qtype.name} tensor of shape {shape} needs {expected} uint8 bytes, got {raw.size} {raw.dtype}")
    if qtype == QT.F32:
        return _as_f32(raw).reshape(shape)
    if qtype == QT.F16:
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if qtype == QT.BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    out = np.empty(n_elements, dtype=np.float32)
    _decode_blocks(raw, qtype, out)
    return out.reshape(shape)


# The IEEE exponent bits of each float width: all set means NaN or infinity.
_EXPONENT_MASKS: dict[QT, tuple[np.dtype, int]] = {
    QT.F32: (np.dtype("<u4"), 0x7F800000), QT.F16: (np.dtype("<u2"), 0x7C00), QT.BF16: (np.dtype("<u2"), 0x7F80),
}
_F16_SCALE_FIELDS = ("d", "m", "dmin")  # the f16 scale and minimum fields of ggml's blocks


def first_non_finite(raw: np.ndarray, qtype: QT) -> int | None:
    """Index of the first value (F32, F16, BF16) or block (block-quantized types: its f16 scales) of
    `raw` that holds NaN or infinity, or None when all are finite, as ggml_validate_row_data checks.

    Read from the bits, so nothing is converted; a quantized block's integer codes cannot be non-finite."""
    qtype = QT(qtype)
    if qtype in _EXPONENT_MASKS:
        dtype, mask = _EXPONENT_MASKS[qtype]
        bits = np.frombuffer(raw, dtype=dtype) if raw.ctypes.data % dtype.itemsize else raw.view(dtype)
        bad = np.flatnonzero((bits & mask) == mask)
        return int(bad[0]) if len(bad) else None
    if qtype not in _BLOCK_DTYPES:
        return None
    blocks = raw.view(_BLOCK_DTYPES[qtype])
    bad_blocks = np.zeros(len(blocks), dtype=bool)
    for name in _F16_SCALE_FIELDS:
        if name in blocks.dtype.names:
            bad_blocks |= (blocks[name].view(np.uint16) & 0x7C00) == 0x7C00
    bad = np.flatnonzero(bad_blocks)
    return int(bad[0]) if len(bad) else None


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """f32 values [..., n] (n whole blocks of 32) as Q8_0 bytes [..., n / 32 * 34], rounded as ggml's
    CPU from_float for Q8_0 does on x86 (quantize_row_q8_0): d = amax / 127 stored as f16, and
    q = round-half-even(x * (127 / amax)), 0 for a block of zeros."""
    blocks = _blocks_of(x, QT.Q8_0)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    out = np.empty(len(blocks), dtype=_BLOCK_DTYPES[QT.Q8_0])
    out["d"] = amax / np.float32(127)
    out["qs"] = np.rint(blocks * inv[:, None])
    return out.view(np.uint8).reshape(x.shape[:-1] + (-1,))


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """f32 values [..., n] as Q4_0 bytes [..., n / 32 * 18], as ggml's quantize_row_q4_0_ref (the CPU's
    from_float for Q4_0): d = (the first value of largest magnitude) / -8 stored as f16, and
    q = min(15, trunc(x / d + 8.5)); element j of a block in the low nibble of byte j, j + 16 in its
    high nibble."""
    blocks = _blocks_of(x, QT.Q4_0)
    signed_max = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    d = signed_max / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.minimum(15, (blocks * inv[:, None] + np.float32(8.5)).astype(np.int32)).astype(np.uint8)
    out = np.empty(len(blocks), dtype=_BLOCK_DTYPES[QT.Q4_0])
    out["d"] = d
    out["qs"] = q[:, :16] | (q[:, 16:] << 4)
    return out.view(np.uint8).reshape(x.shape[:-1] + (-1,))


def quantize(values: np.ndarray, qtype) -> np.ndarray:
    """f32 values [..., n] as qtype's blocks, bytes [..., row bytes], rounded as ggml's CPU rounds
    them (the block types a KV cache may hold: Q8_0, Q4_0)."""
    qtype = QT[qtype] if isinstance(qtype, str) else QT(qtype)
    if qtype not in _ENCODERS:
        raise ValueError(f"no encoder for {qtype.name}")
    return _ENCODERS[qtype](values)


def _blocks_of(x: np.ndarray, qtype: QT) -> np.ndarray:
    """x as f32 rows of one block each; ValueError if its last axis is not whole blocks."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    block_size, _ = block_layout(qtype)
    if x.ndim == 0 or x.shape[-1] % block_size:
        raise ValueError(f"{qtype.name} rows need a multiple of {block_size} values, got shape {x.shape}")
    return x.reshape(-1, block_size)


def _as_f32(raw: np.ndarray) -> np.ndarray:
    """View little-endian float32 bytes without copying when aligned; copy only when it must."""
    if raw.ctypes.data % 4 == 0:
        return raw.view("<f4")
    return np.frombuffer(raw.tobytes(), dtype="<f4")


def _decode_blocks(raw: np.ndarray, qtype: QT, out: np.ndarray) -> None:
    """Decode block-quantized bytes chunk by chunk into `out` (flat float32)."""
    blocks = raw.view(_BLOCK_DTYPES[qtype])
    block_size, _ = block_layout(qtype)
    decode = _DECODERS[qtype]
    out_blocks = out.reshape(-1, block_size)
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        decode(blocks[start:stop], out_blocks[start:stop])


def _f32(field: np.ndarray) -> np.ndarray:
    """A per-block scalar field (f16 scale) as a float32 column that broadcasts over the block."""
    return field.astype(np.float32)[:, None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Split (n, 16) packed bytes into (n, 32) values: low nibbles give elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Bit j of each block's little-endian 32-bit `qh` (given as 4 bytes) as the fifth bit of element j."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _decode_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(b["qs"], _f32(b["d"]), out=out)


def _decode_q4_0(b: np.ndarray, out: np.ndarray) -> None:
    q = _nibbles(b["qs"]).view(np.int8) - np.int8(8)
    np.multiply(q, _f32(b["d"]), out=out)


def _decode_q4_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_nibbles(b["qs"]), _f32(b["d"]), out=out)
    out += _f32(b["m"])


def _decode_q5_0(b: np.ndarray, out: np.ndarray) -> None:
    q = (_nibbles(b["qs"]) | _high_bits(b["qh"])).view(np.int8) - np.int8(16)
    np.multiply(q, _f32(b["d"]), out=out)


def _decode_q5_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_nibbles(b["qs"]) | _high_bits(b["qh"]), _f32(b["d"]), out=out)
    out += _f32(b["m"])


def _k_crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes of 2-bit values as (n, 16, 16) groups: element 128*h + 32*j + l is bits
    2j..2j+1 of byte 32*h + l, so group g = 8*h + 2*j + l // 16 holds consecutive elements."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def _decode_q2_k(b: np.ndarray, out: np.ndarray) -> None:
    # out = d * (scale & 15) * q - dmin * (scale >> 4), one 4+4-bit scale byte per group of 16
    scale = (_f32(b["d"]) * (b["scales"] & 0x0F))[:, :, None]
    offset = (_f32(b["dmin"]) * (b["scales"] >> 4))[:, :, None]
    out3 = out.reshape(-1, 16, 16)
    np.multiply(_k_crumbs(b["qs"]), scale, out=out3)
    out3 -= offset


def _q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes as 16 signed six-bit scales: the low 4 bits of scale j are nibble j // 8
    of byte j % 8, the high 2 bits are bits 2*(j // 4).. of byte 8 + j % 4; stored +32."""
    low = (scales[:, None, 0:8] >> np.array([0, 4], dtype=np.uint8)[None, :, None]) & 0x0F
    high = (scales[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]) & 0x03
    return (low.reshape(-1, 16) | (high.reshape(-1, 16) << 4)).astype(np.int8) - np.int8(32)


def _decode_q3_k(b: np.ndarray, out: np.ndarray) -> None:
    # element 128*h + 32*j + l: 2 low bits as Q2_K, minus 4 unless bit 4*h + j of hmask[l] is set
    n = len(b)
    bit = np.arange(8, dtype=np.uint8)[None, :, None]
    high = ((b["hmask"][:, None, :] >> bit) & 1).reshape(n, 16, 16)
    q = _k_crumbs(b["qs"]).view(np.int8) - ((high ^ 1) << 2).view(np.int8)
    scale = (_f32(b["d"]) * _q3_k_scales(b["scales"]))[:, :, None]
    np.multiply(q, scale, out=out.reshape(n, 16, 16))


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    lo, hi, mixed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc, mn


def _k_sub_blocks(b: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    """Apply Q4_K/Q5_K's per-32-element scale and min: out = d*sc*q - dmin*m over 8 sub-blocks."""
    n = len(b)
    sc, mn = _k_scales_mins(b["scales"])
    scale = (_f32(b["d"]) * sc)[:, :, None]
    offset = (_f32(b["dmin"]) * mn)[:, :, None]
    out3 = out.reshape(n, 8, 32)
    np.multiply(q.reshape(n, 8, 32), scale, out=out3)
    out3 -= offset


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 packed bytes as 256 values: each 32-byte group gives one sub-block of low nibbles,
    then one of high nibbles."""
    n = len(qs)
    groups = qs.reshape(n, 4, 1, 32)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=2).reshape(n, 256)


def _decode_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    _k_sub_blocks(b, _k_nibbles(b["qs"]), out)


def _decode_q5_k(b: np.ndarray, out: np.ndarray) -> None:
    n = len(b)
    sub_block = np.arange(8, dtype=np.uint8)[None, :, None]
    high = ((b["qh"][:, None, :] >> sub_block) & 1) << 4
    _k_sub_blocks(b, _k_nibbles(b["qs"]) | high.reshape(n, 256), out)


def _decode_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    # Each half of 128 elements reads 64 ql bytes and 32 qh bytes: element 32*k + l takes the
    # low (k < 2) or high (k >= 2) nibble of ql[l + 32*(k % 2)] and bits 2k..2k+1 of qh[l].
    n = len(b)
    ql = b["ql"].reshape(n, 2, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = ((b["qh"].reshape(n, 2, 1, 32) >> shifts) & 3) << 4
    q = (low | high).view(np.int8) - np.int8(32)
    scale = (_f32(b["d"]) * b["scales"])[:, :, None]
    np.multiply(q.reshape(n, 16, 16), scale, out=out.reshape(n, 16, 16))


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 scale bytes as ggml's GGML_E8M0_TO_FP32_HALF reads them: 2^(e - 128) as f32
    (the bit patterns 0x00200000 and 0x00400000, subnormal, for e = 0 and 1)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32).view(np.float32)


def _decode_iq4_nl(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(IQ4_VALUES[_nibbles(b["qs"])], _f32(b["d"]), out=out)


def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """IQ4_XS's eight six-bit sub-block scales minus 32: the low 4 bits are nibble j % 2 of
    scales_l[j // 2], the high 2 bits are bits 2j..2j+1 of scales_h."""
    low = (b["scales_l"][:, :, None] >> np.array([0, 4], dtype=np.uint8)) & 0x0F
    high = (b["scales_h"][:, None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    return (low.reshape(-1, 8) | (high << 4)).astype(np.int8) - np.int8(32)


def _decode_iq4_xs(b: np.ndarray, out: np.ndarray) -> None:
    # 8 sub-blocks of 32, each 16 bytes of nibbles as IQ4_NL's block, scaled by d * (ls - 32)
    n = len(b)
    values = IQ4_VALUES[_nibbles(b["qs"].reshape(n * 8, 16))].reshape(n, 8, 32)
    scale = (_f32(b["d"]) * _iq4_xs_scales(b))[:, :, None]
    np.multiply(values, scale, out=out.reshape(n, 8, 32))


def _decode_mxfp4(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(MXFP4_VALUES[_nibbles(b["qs"])], e8m0_half(b["e"])[:, None], out=out)


_DECODERS: dict[QT, Callable[[np.ndarray, np.ndarray], None]] = {
    QT.Q8_0: _decode_q8_0,
    QT.Q4_0: _decode_q4_0,
    QT.Q4_1: _decode_q4_1,
    QT.Q5_0: _decode_q5_0,
    QT.Q5_1: _decode_q5_1,
    QT.Q2_K: _decode_q2_k,
    QT.Q3_K: _decode_q3_k,
    QT.Q4_K: _decode_q4_k,
    QT.Q5_K: _decode_q5_k,
    QT.Q6_K: _decode_q6_k,
    QT.IQ4_NL: _decode_iq4_nl,
    QT.IQ4_XS: _decode_iq4_xs,
    QT.MXFP4: _decode_mxfp4,
}

_ENCODERS: dict[QT, Callable[[np.ndarray], np.ndarray]] = {
    QT.Q8_0: quantize_q8_0,
    QT.Q4_0: quantize_q4_0,
}
