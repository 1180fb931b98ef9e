"""IQ4_NL, IQ4_XS and MXFP4 against ggml itself (tests/data/ggml_quants.json, from
scripts/tools/ggml_quant_reference.py): the numpy decoders (core/quants.py) and the CPU's compiled ones
(core/backends/cpu/lut4.py) equal ggml's dequantize_row_* bit for bit, on ggml's own quantization of
random rows and on random blocks; the CPU's integer dot products (lut4.py's scalar ones, quant/lut4_avx2.py's
AVX2 ones) match ggml's vec_dot against ggml's own 8-bit activation blocks, and quant/activations.py's
quantizers make those same blocks from the f32 activations. The
synthetic writer's quantizers: gguf's for MXFP4 (ggml's bytes), its own for IQ4_NL and IQ4_XS.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

from ggrun.core.backends.cpu import lut4 as L4
from ggrun.core.backends.cpu.quant import activations, codes, decode, lut4_avx2
from ggrun.core.dtypes import DType
from ggrun.core.quants import dequantize, e8m0_half
from ggrun.loaders import synthetic as synth

GGML = json.loads((Path(__file__).parents[1] / "data" / "ggml_quants.json").read_text(encoding="utf-8"))
K = GGML["k"]
TYPES = [DType.IQ4_NL, DType.IQ4_XS, DType.MXFP4]


def _rows(hexes: list[str]) -> np.ndarray:
    return np.stack([np.frombuffer(bytes.fromhex(h), np.uint8) for h in hexes])


def _weights(dtype: DType) -> np.ndarray:
    """ggml's quantization of the random rows, then the random blocks: stored rows [7, row bytes]."""
    case = GGML[dtype.name]
    return _rows(case["blocks"] + case["random"])


def _ggml_values(dtype: DType) -> np.ndarray:
    return _rows(GGML[dtype.name]["values"]).view(np.float32)


def _ggml_acts(dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """ggml's activation blocks (Q8_0: f16 d, 32 quants; Q8_K: f32 d, 256 quants, 16 sums) as the
    kernels' arrays: quants int8 [N, K] and scales f32 [N, K / 32] (Q8_K: the first K / 256 used)."""
    raw = _rows(GGML[dtype.name]["acts"])
    n = raw.shape[0]
    d = np.zeros((n, K // 32), np.float32)
    if dtype is DType.IQ4_XS:
        blocks = raw.reshape(n, K // 256, 292)
        d[:, :K // 256] = blocks[:, :, :4].copy().view(np.float32)[..., 0]
        return blocks[:, :, 4:260].reshape(n, K).view(np.int8), d
    blocks = raw.reshape(n, K // 32, 34)
    d[:] = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    return blocks[:, :, 2:].reshape(n, K).view(np.int8), d


@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_numpy_decoder_is_ggmls(dtype):
    w = _weights(dtype)
    ours = dequantize(w.reshape(-1), dtype.name, (w.shape[0], K))
    np.testing.assert_array_equal(ours.view(np.uint32), _ggml_values(dtype).view(np.uint32))


@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_compiled_decoder_is_ggmls(dtype):
    """quant/decode.py's row decoders (weight tiles, get_rows) hand these types to lut4.py's."""
    w = _weights(dtype)
    out = np.full((w.shape[0], K), np.nan, np.float32)
    decode.dequantize_rows(L4.TYPES[dtype], w, 0, w.shape[0], out)
    np.testing.assert_array_equal(out.view(np.uint32), _ggml_values(dtype).view(np.uint32))
    rows = np.full((2, K), np.nan, np.float32)
    decode.get_rows(L4.TYPES[dtype], w, np.array([5, 1], np.int32), rows)
    np.testing.assert_array_equal(rows, _ggml_values(dtype)[[5, 1]])


def _product_kernels() -> list:
    """lut4.py's scalar kernels, and quant/lut4_avx2.py's where this CPU runs AVX2."""
    kernels = [pytest.param(L4, id="scalar")]
    if codes.SIMD != "generic":
        kernels.append(pytest.param(lut4_avx2, id="avx2"))
    return kernels


@pytest.mark.parametrize("kernels", _product_kernels())
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "par"])
@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_dot_products_are_ggmls_vec_dot(dtype, parallel, kernels):
    w = _weights(dtype)
    qs, d = _ggml_acts(dtype)
    out = np.zeros((qs.shape[0], w.shape[0]), np.float32)
    if parallel:  # three chunks over the seven rows: the last pass of four repeats its last row
        kernels.mul_mat_q8_par(L4.TYPES[dtype], w, qs, d, out, 3)
    else:
        kernels.mul_mat_q8(L4.TYPES[dtype], w, qs, d, out)
    expected = np.frombuffer(bytes.fromhex(GGML[dtype.name]["dots"]), np.float32).reshape(w.shape[0], -1).T
    # the same exact integer sums per block (IQ4_XS: per super-block), scaled alike; only the order in
    # which ggml's eight AVX2 lanes add the blocks' products differs
    scale = np.abs(_ggml_values(dtype)) @ np.abs(qs * np.repeat(d[:, :K // 32], 32, axis=1) if dtype is not DType.IQ4_XS
                                                 else qs * np.repeat(d[:, :K // 256], 256, axis=1)).T
    assert np.all(np.abs(out - expected) <= 2e-6 * scale.T), np.abs(out - expected).max()


@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_activation_blocks_are_ggmls(dtype):
    """quant/activations.py's quantizer, as the binder calls it for these types, makes ggml's blocks of the activations."""
    a = np.frombuffer(bytes.fromhex(GGML["a"]), np.float32).reshape(-1, K)
    qs, d, s, sums = codes.act_arrays(np.zeros(codes.act_arrays_bytes(a.shape[0], K), np.uint8), a.shape[0], K)
    activations.quantize_rows(codes.ACT_OF[dtype], a, qs, d, s, sums)
    want_qs, want_d = _ggml_acts(dtype)
    np.testing.assert_array_equal(qs, want_qs)
    np.testing.assert_array_equal(d, want_d)


def test_e8m0_half_reads_every_exponent_as_ggml():
    """GGML_E8M0_TO_FP32_HALF: 2^(e - 128), the two smallest as f32 subnormals."""
    e = np.arange(256, dtype=np.uint8)
    want = np.array([np.ldexp(np.float64(1), int(x) - 128) for x in e]).astype(np.float32)
    np.testing.assert_array_equal(e8m0_half(e), want)


def _x() -> np.ndarray:
    return np.frombuffer(bytes.fromhex(GGML["x"]), np.float32).reshape(-1, K)


@pytest.mark.parametrize("dtype", [DType.IQ4_NL, DType.IQ4_XS], ids=str)
def test_synthetic_writers_quantizer_is_about_as_close_as_ggmls(dtype):
    """loaders/synthetic.py's own IQ4 quantizer (gguf has none): its blocks decode near the values, within 15%
    of the squared error of ggml's quantization (its values from dequantize_row_*) of the same rows."""
    x = _x()
    ours = dequantize(synth.quantize_iq4_nl(x) if dtype is DType.IQ4_NL else synth.quantize_iq4_xs(x),
                      dtype.name, x.shape)
    ggml = _ggml_values(dtype)[:len(x)]
    for r in range(len(x)):
        assert np.sum((ours[r] - x[r]) ** 2) <= 1.15 * np.sum((ggml[r] - x[r]) ** 2) + 1e-12, r


def test_gguf_mxfp4_quantizer_is_ggmls():
    """The writer stores MXFP4 through gguf's quantizer: the bytes of ggml's quantize_row_mxfp4."""
    got = np.asarray(gguf_quantize(_x(), QT.MXFP4)).view(np.uint8).reshape(len(_x()), -1)
    np.testing.assert_array_equal(got, _rows(GGML["MXFP4"]["blocks"]))
