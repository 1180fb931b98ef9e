"""Weights repacked once at load into the layouts the decode kernels read fastest: "r8" for AVX2 (groups of
8 rows, avx2_r8.py), "r16" for AVX-512 (r8's layout with 16 rows, avx512.py) and "ri64" for the portable
kernels (groups of 64 rows, portable.py); plus the constants the r8 and r16 kernels share (how far they
prefetch, how many activation rows a tiled pass takes, how many weights one call runs).

The bytes written here are cached on disk (repack_cache.py keys them by this file). Listed in
jit.SHARED_SOURCES: the kernels compile in its constants and `_r8_block`.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.quant.codes import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0


# ---------------------------------------------------------------------------------------------
# "r8": weights repacked once at load for AVX2 (matmul.repack). Rows in groups of 8; per group
# and 32-block: the 8 rows' f16 scales d, (Q4_1/Q5_1) f16 mins m, (Q5) fifth bits, then the
# quants as 32-bit lanes, one lane per row: vector j holds bytes 4j..4j+3 of every row. One
# maddubs multiplies 4 weights of each of the 8 rows by 4 broadcast activation bytes, so the
# lanes of the accumulator are the 8 rows' results and the scales are applied 8 rows at a time.
# The k-quants (Q4_K, Q5_K, Q6_K) follow the same plan per 256-block (see `_repack_r8_k`).
# ---------------------------------------------------------------------------------------------

R8 = 8
PF_GROUPS = 4  # groups ahead that the r8 kernels prefetch
R8_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)


@kernel(inline="always")
def _r8_block(code):
    """Bytes per group and block, and where the quants start in them."""
    if code == Q4_0:
        return 144, 16
    if code == Q4_1:
        return 160, 32
    if code == Q5_0:
        return 176, 48
    if code == Q5_1:
        return 192, 64
    return 272, 16


def r8_block_bytes(code: int, rows: int = R8) -> int:
    """Bytes of one group of `rows` rows (r8: 8) per block (32 elements, 256 for the k-quants): the
    layout's every part holds a value per row, so it scales with the rows."""
    return ({Q4_K: 1184, Q5_K: 1440, Q6_K: 1680}.get(code) or _r8_block.py_func(code)[0]) * rows // R8


R8_CHUNK_GROUPS = 512  # groups repacked at a time: the temporaries stay small and in cache


def repack_r8(code: int, raw: np.ndarray, rows: int = R8) -> np.ndarray:
    """ggml blocks [M, row bytes] (uint8) -> r8 groups [ceil(M / 8), blocks * group bytes] (uint8);
    with `rows`, groups of that many rows laid out alike (AVX-512's r16, see avx512.py)."""
    one = _repack_r8_k if code in (Q4_K, Q5_K, Q6_K) else _repack_r8_legacy
    m = raw.shape[0]
    groups = (m + rows - 1) // rows
    if groups <= R8_CHUNK_GROUPS:
        return one(code, raw, rows)
    out = None
    for g0 in range(0, groups, R8_CHUNK_GROUPS):
        part = one(code, raw[g0 * rows:(g0 + R8_CHUNK_GROUPS) * rows], rows)
        if out is None:
            out = np.empty((groups, part.shape[1]), dtype=np.uint8)
        out[g0:g0 + part.shape[0]] = part
    return out


def _lanes(q: np.ndarray) -> np.ndarray:
    """[g, b, row, 4 * n bytes] -> [g, b, n vectors * 8 lanes * 4 bytes]: vector j lane r = row r's bytes 4j..4j+3."""
    g, nb, rows, width = q.shape
    return q.reshape(g, nb, rows, width // 4, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, -1)


def _grouped(raw: np.ndarray, ts: int, rows: int) -> np.ndarray:
    """ggml rows as [groups, blocks, rows, block bytes], zero rows padding the last group."""
    m = raw.shape[0]
    nb = raw.shape[1] // ts
    groups = (m + rows - 1) // rows
    blocks = np.zeros((groups * rows, nb, ts), dtype=np.uint8)
    blocks[:m] = raw.reshape(m, nb, ts)
    return blocks.reshape(groups, rows, nb, ts).transpose(0, 2, 1, 3)


def _repack_r8_k(code: int, raw: np.ndarray, rows: int) -> np.ndarray:
    """Q4_K/Q5_K per group and super-block: d, dmin (8 f16 each), the six-bit scales and mins
    unpacked to bytes [sub-block][row], (Q5_K) the fifth bits as 8 lane vectors of qh, then the
    quants as 32 lane vectors (32 bytes of each row per 64 elements). Q6_K: d, the int8 scales
    [group of 16][row], ql as 32 lane vectors, qh as 16."""
    ts = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[code]
    b = _grouped(raw, ts, rows)
    groups, nb = b.shape[:2]
    if code == Q6_K:
        parts = [b[..., 208:210].reshape(groups, nb, 2 * rows),
                 b[..., 192:208].transpose(0, 1, 3, 2).reshape(groups, nb, 16 * rows),
                 _lanes(b[..., 0:128]), _lanes(b[..., 128:192])]
    else:
        sc = b[..., 4:16]
        lo, hi, mixed = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
        scales = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 6) << 4)], axis=-1)  # [g, b, row, sub]
        mins = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 6) << 4)], axis=-1)
        parts = [b[..., 0:2].reshape(groups, nb, 2 * rows), b[..., 2:4].reshape(groups, nb, 2 * rows),
                 scales.transpose(0, 1, 3, 2).reshape(groups, nb, 8 * rows),
                 mins.transpose(0, 1, 3, 2).reshape(groups, nb, 8 * rows)]
        if code == Q5_K:
            parts.append(_lanes(b[..., 16:48]))
        parts.append(_lanes(b[..., ts - 128:ts]))
    out = np.concatenate(parts, axis=-1)
    assert out.shape[-1] == r8_block_bytes(code, rows)
    return out.reshape(groups, -1)


def _repack_r8_legacy(code: int, raw: np.ndarray, rows: int) -> np.ndarray:
    """The legacy types: per group and block d (8 f16), (Q4_1/Q5_1) m, (Q5) qh, then the quants.

    The last group is padded with zero rows (scale 0). Q5's fifth bits are reordered so that
    bit 2j + h of byte t of a row's 32 bits is the bit of element 16h + 4j + t: the bit that
    joins the nibble in lane byte t of vector j (h = 0: low nibbles, h = 1: high nibbles).
    """
    ts = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}[code]
    blocks = _grouped(raw, ts, rows)  # [g, b, row, bytes]
    groups, nb = blocks.shape[:2]
    size, q_at = (v * rows // R8 for v in _r8_block.py_func(code))
    h = 2 * rows  # bytes of one f16 per row
    out = np.empty((groups, nb, size), dtype=np.uint8)
    out[:, :, 0:h] = blocks[:, :, :, 0:2].reshape(groups, nb, h)  # d
    at = 2
    if code in (Q4_1, Q5_1):
        out[:, :, h:2 * h] = blocks[:, :, :, 2:4].reshape(groups, nb, h)  # m
        at = 4
    if code in (Q5_0, Q5_1):
        bits = np.unpackbits(blocks[:, :, :, at:at + 4], axis=-1, bitorder="little")  # element e -> bits[e]
        e = np.array([16 * (i % 2) + 4 * ((i % 8) // 2) + i // 8 for i in range(32)])  # new bit i = 8t + 2j + h
        out[:, :, q_at - 4 * rows:q_at] = np.packbits(bits[..., e], axis=-1, bitorder="little").reshape(groups, nb, -1)
        at += 4
    qs = blocks[:, :, :, at:]  # [g, b, row, 16 or 32 bytes]
    lanes = qs.reshape(groups, nb, rows, -1, 4).transpose(0, 1, 3, 2, 4)  # [g, b, j, row, 4]
    out[:, :, q_at:] = lanes.reshape(groups, nb, -1)
    return out.reshape(groups, nb * size)


# "r16": the r8 layout with groups of 16 rows, for AVX-512 (avx512.py); Q8_0's quants stored plus 128
R16 = 16
R16_TYPES = R8_TYPES


def r16_block_bytes(code: int) -> int:
    """Bytes of one r16 group (16 rows) per block (32 elements, 256 for the k-quants)."""
    return r8_block_bytes(code, R16)


def repack_r16(code: int, raw: np.ndarray) -> np.ndarray:
    """ggml blocks [M, row bytes] (uint8) -> r16 groups [ceil(M / 16), blocks * group bytes] (uint8)."""
    out = repack_r8(code, raw, R16)
    if code == Q8_0:  # the quants plus 128 (unsigned, as vpdpbusd reads them): bytes 32.. of each block
        blocks = out.reshape(out.shape[0], -1, r16_block_bytes(code))
        blocks[:, :, 32:] ^= 0x80
    return out


# How the r8 and r16 kernels walk the repacked rows: activation rows per pass of the tiled kernels, and
# weights one product call takes (avx2_r8.py's and avx512.py's drivers: slots past n_parts repeat one)
TOKENS = 4
MAX_PARTS = 3


# ---------------------------------------------------------------------------------------------
# "ri64": the legacy types repacked for the portable kernels (CPUs without AVX2). Rows in groups
# of 64; per group and block, byte t of all 64 rows is contiguous (q [groups, blocks, bytes, 64]),
# so the innermost loop runs across rows with a broadcast activation value: LLVM vectorizes it
# (no horizontal sum). Scales and mins are f32 [groups, blocks, 64]; Q5's values are whole bytes.
# ---------------------------------------------------------------------------------------------

RI = 64


class RI64(NamedTuple):
    """A weight in the ri64 layout (see above)."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray


def repack_ri64(code: int, raw: np.ndarray) -> RI64:
    """ggml blocks [M, row bytes] (uint8) of a legacy type -> RI64, zero rows padding the last group."""
    from ggrun.core.quants import dequantize

    ts = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}[code]
    m = raw.shape[0]
    nb = raw.shape[1] // ts
    groups = (m + RI - 1) // RI
    blocks = np.zeros((groups * RI, nb, ts), dtype=np.uint8)
    blocks[:m] = raw.reshape(m, nb, ts)
    by_row = blocks.reshape(groups, RI, nb, ts)
    d = by_row[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32).transpose(0, 2, 1)
    mins = np.zeros_like(d)
    if code in (Q4_1, Q5_1):
        mins = by_row[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32).transpose(0, 2, 1)
    if code in (Q4_0, Q4_1):
        q = by_row[..., ts - 16:]
    elif code == Q8_0:
        q = by_row[..., 2:]
    else:  # Q5: the values 0..31 as bytes (the decoded value is d * (q - 16) or d * q + m)
        name = "Q5_0" if code == Q5_0 else "Q5_1"
        one = blocks.copy()
        one[..., 0:2] = np.array([1.0], "<f2").view(np.uint8)  # d = 1, m = 0: the integers
        if code == Q5_1:
            one[..., 2:4] = 0
        values = dequantize(one.reshape(-1), name, (groups * RI, nb * 32)) + (16 if code == Q5_0 else 0)
        q = values.astype(np.uint8).reshape(groups, RI, nb, 32)
    return RI64(np.ascontiguousarray(q.transpose(0, 2, 3, 1)), np.ascontiguousarray(d), np.ascontiguousarray(mins))
