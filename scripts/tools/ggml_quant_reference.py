#!/usr/bin/env python3
"""Write tests/data/ggml_quants.json: what llama.cpp's ggml computes for the IQ4_NL, IQ4_XS and MXFP4
weight types, as facts the tests compare ggrun with (ggml itself is not needed at test time).

Through ctypes on the ggml libraries of llama.cpp's CPU build (scripts/ggml_kv_reference.py's Ggml), per type:
- `blocks`: rows of random values quantized by ggml's CPU from_float (quantize_row_iq4_nl, ...);
- `random`: rows of random block bytes (every index, scale and exponent byte appears), finite f16 scales;
- `values`: both decoded by ggml's to_float (dequantize_row_*), which ggrun's decoders must equal bit for bit;
- `acts` and `dots`: activation rows quantized by the CPU's from_float of the type's vec_dot_type (Q8_0 or
  Q8_K) and ggml's vec_dot of each weight row (`blocks` then `random`) with each of them.

    .venv/bin/python scripts/tools/ggml_quant_reference.py [--llama-bin DIR]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ggml_kv_reference import DEFAULT_BIN, Ggml  # noqa: E402  (this folder, beside this script)

ROOT = Path(__file__).resolve().parents[2]
# ggml type id, elements per block, bytes per block, vec_dot_type's id and bytes per block
TYPES = {"IQ4_NL": (20, 32, 18, 8, 34), "IQ4_XS": (23, 256, 136, 15, 292), "MXFP4": (39, 32, 17, 8, 34)}
K = 512  # values per row: two IQ4_XS super-blocks, sixteen blocks of the others


class _Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_ROW_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_DOT_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def from_float(ggml: Ggml, type_id: int, row_bytes: int, x: np.ndarray) -> np.ndarray:
    """Rows x (f32) quantized by the CPU's from_float of ggml type `type_id`."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], row_bytes), dtype=np.uint8)
    fn = _ROW_FN(ggml.cpu.ggml_get_type_traits_cpu(type_id).contents.from_float)
    for r in range(x.shape[0]):
        fn(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
    return out


def to_float(ggml: Ggml, type_id: int, rows: np.ndarray) -> np.ndarray:
    """Rows of blocks decoded by ggml's to_float (dequantize_row_*)."""
    ggml.base.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    fn = _ROW_FN(ggml.base.ggml_get_type_traits(type_id).contents.to_float)
    out = np.zeros((rows.shape[0], K), dtype=np.float32)
    for r in range(rows.shape[0]):
        row = np.ascontiguousarray(rows[r])
        fn(row.ctypes.data, out[r].ctypes.data, K)
    return out


def vec_dot(ggml: Ggml, type_id: int, w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """ggml's vec_dot of every weight row with every activation row: f32 [rows of w, rows of a]."""
    fn = _DOT_FN(ggml.cpu.ggml_get_type_traits_cpu(type_id).contents.vec_dot)
    out = np.zeros((w.shape[0], a.shape[0]), dtype=np.float32)
    s = ctypes.c_float()
    for i in range(w.shape[0]):
        wi = np.ascontiguousarray(w[i])
        for j in range(a.shape[0]):
            aj = np.ascontiguousarray(a[j])
            fn(K, ctypes.addressof(s), 0, wi.ctypes.data, 0, aj.ctypes.data, 0, 1)
            out[i, j] = s.value
    return out


def random_blocks(rng: np.random.Generator, name: str, n_rows: int) -> np.ndarray:
    """Rows of random block bytes whose f16 scales are finite (MXFP4's exponent byte takes any value)."""
    _, block, size, _, _ = TYPES[name]
    raw = rng.integers(0, 256, size=(n_rows, K // block, size), dtype=np.uint8)
    if name != "MXFP4":
        d = (rng.uniform(-0.05, 0.05, size=(n_rows, K // block))).astype(np.float16)
        raw[..., 0:2] = d.view(np.uint8).reshape(n_rows, K // block, 2)
    else:
        raw[..., 0] = rng.integers(100, 140, size=(n_rows, K // block))  # products of a sensible size
        raw[0, 0:2, 0], raw[1, 0, 0] = (0, 1), 200  # the subnormal halves, a large exponent
    return raw.reshape(n_rows, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", type=Path, default=Path(os.environ.get("LLAMA_BIN", DEFAULT_BIN)))
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/ggml_quants.json")
    args = ap.parse_args()
    ggml = Ggml(args.llama_bin)
    rng = np.random.default_rng(32)
    x = (rng.standard_normal((4, K)) * rng.uniform(0.01, 8, size=(4, 1))).astype(np.float32)
    x[1, :32] = 0  # a block of zeros
    x[2, 32:64] *= 1e-3  # a block much smaller than its neighbours (IQ4_XS's sub-block scales)
    acts = (rng.standard_normal((3, K)) * rng.uniform(0.1, 4, size=(3, 1))).astype(np.float32)
    data = {"producer": "scripts/tools/ggml_quant_reference.py with the ggml of llama.cpp 0c1e570 (vendored by "
                        "llama-cpp-python 0.3.36, CPU build of ../shared/tools/cpu_anchor.sh)",
            "k": K, "x": x.tobytes().hex(), "a": acts.tobytes().hex()}
    for name, (type_id, block, size, dot_id, dot_size) in TYPES.items():
        blocks = from_float(ggml, type_id, K // block * size, x)
        rand = random_blocks(rng, name, 3)
        w = np.concatenate([blocks, rand])
        a = from_float(ggml, dot_id, K // (256 if dot_id == 15 else 32) * dot_size, acts)
        data[name] = {"blocks": [r.tobytes().hex() for r in blocks], "random": [r.tobytes().hex() for r in rand],
                      "values": [r.tobytes().hex() for r in to_float(ggml, type_id, w)],
                      "acts": [r.tobytes().hex() for r in a], "dots": vec_dot(ggml, type_id, w, a).tobytes().hex()}
    args.out.write_text(json.dumps(data) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
