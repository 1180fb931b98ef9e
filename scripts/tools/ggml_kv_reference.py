#!/usr/bin/env python3
"""Write tests/data/ggml_kv_quant.json: what llama.cpp's ggml computes for quantized KV caches, as
facts the tests compare ggrun with (ggml itself is not needed at test time).

It calls the ggml libraries of llama.cpp's CPU build (`bash ../shared/tools/cpu_anchor.sh` makes them;
pass their folder with --llama-bin or $LLAMA_BIN) through ctypes:
- `from_float`: rows quantized by the CPU's from_float of Q8_0 and Q4_0 (what set_rows stores);
- `flash_attn`: ggml_flash_attn_ext over a Q4_0 K cache and a Q8_0 V cache (one thread), with
  its inputs: the values ggrun's compiled attention must reproduce.

    .venv/bin/python scripts/tools/ggml_kv_reference.py [--llama-bin DIR]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN = Path.home() / ".cache/ggrun-anchor/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
ROW_BYTES = {"q4_0": 18, "q8_0": 34}  # per block of 32


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _TraitsCPU(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


class Ggml:
    """The few ggml calls this script makes."""

    def __init__(self, bin_dir: Path) -> None:
        self.base = ctypes.CDLL(str(bin_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(bin_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        b, c, p = self.base, self.cpu, ctypes.c_void_p
        c.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCPU)
        c.ggml_cpu_init()
        b.ggml_init.restype, b.ggml_init.argtypes = p, [_InitParams]
        b.ggml_new_tensor_4d.restype = p
        b.ggml_new_tensor_4d.argtypes = [p, ctypes.c_int] + [ctypes.c_int64] * 4
        b.ggml_flash_attn_ext.restype = p
        b.ggml_flash_attn_ext.argtypes = [p] * 5 + [ctypes.c_float] * 3
        b.ggml_new_graph.restype, b.ggml_new_graph.argtypes = p, [p]
        b.ggml_build_forward_expand.argtypes = [p, p]
        b.ggml_get_data.restype, b.ggml_get_data.argtypes = p, [p]
        b.ggml_free.argtypes = [p]
        c.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]

    def from_float(self, dtype: str, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros(x.size // 32 * ROW_BYTES[dtype], dtype=np.uint8)
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
            self.cpu.ggml_get_type_traits_cpu(GGML_TYPE[dtype]).contents.from_float)
        fn(x.ctypes.data, out.ctypes.data, x.size)
        return out.reshape(x.shape[0], -1)

    def flash_attn(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, type_k: str, type_v: str,
                   mask: np.ndarray, scale: float) -> np.ndarray:
        """q f32 [tokens, heads, d]; k, v stored rows [n_kv, heads_kv * row bytes]; mask f16 [tokens, n_kv]."""
        n, h, d = q.shape
        n_kv, h_kv = k.shape[0], k.shape[1] // (d // 32 * ROW_BYTES[type_k])
        b = self.base
        ctx = b.ggml_init(_InitParams(64 << 20, None, False))
        try:
            tq = b.ggml_new_tensor_4d(ctx, GGML_TYPE["f32"], d, n, h, 1)
            tk = b.ggml_new_tensor_4d(ctx, GGML_TYPE[type_k], d, n_kv, h_kv, 1)
            tv = b.ggml_new_tensor_4d(ctx, GGML_TYPE[type_v], d, n_kv, h_kv, 1)
            tm = b.ggml_new_tensor_4d(ctx, GGML_TYPE["f16"], n_kv, n, 1, 1)
            # ggml's k [d, n_kv, heads_kv] holds each head's cells together: heads outermost
            per_head = lambda rows, h_kv: np.ascontiguousarray(rows.reshape(rows.shape[0], h_kv, -1).transpose(1, 0, 2))
            for t, data in ((tq, q.transpose(1, 0, 2)), (tk, per_head(k, h_kv)), (tv, per_head(v, h_kv)), (tm, mask)):
                data = np.ascontiguousarray(data)
                ctypes.memmove(b.ggml_get_data(t), data.ctypes.data, data.nbytes)
            out = b.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, scale, 0.0, 0.0)
            graph = b.ggml_new_graph(ctx)
            b.ggml_build_forward_expand(graph, out)
            self.cpu.ggml_graph_compute_with_ctx(ctx, graph, 1)
            ptr = ctypes.cast(b.ggml_get_data(out), ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(ptr, shape=(n * h * d,)).copy().reshape(n, h, d)  # [tokens, heads, d]
        finally:
            b.ggml_free(ctx)


def floats(a: np.ndarray) -> list:
    """f32 values as the shortest decimals that read back as the same f32 (np.float32(x) == value)."""
    return [float(np.format_float_positional(x, unique=True)) if np.isfinite(x) else float(x)
            for x in np.asarray(a, dtype=np.float32).reshape(-1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", type=Path, default=Path(os.environ.get("LLAMA_BIN", DEFAULT_BIN)))
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/ggml_kv_quant.json")
    args = ap.parse_args()
    ggml = Ggml(args.llama_bin)
    rng = np.random.default_rng(2025)

    x = (rng.standard_normal((6, 64)) * rng.uniform(0.01, 40, size=(6, 1))).astype(np.float32)
    x[1, :32] = 0  # a block of zeros
    x[2, :4] = [127.0, 62.5, 63.5, -127.0]  # ties of the Q8_0 rounding
    x[3, :3] = [-8.0, 8.0, 4.0]  # the signed largest value of a Q4_0 block
    from_float = {"x": [floats(r) for r in x],
                  **{t: [r.tobytes().hex() for r in ggml.from_float(t, x)] for t in ("q8_0", "q4_0")}}

    n, h, h_kv, d, n_kv = 3, 4, 2, 64, 40
    q = (rng.standard_normal((n, h, d)) * 2).astype(np.float32)
    k = ggml.from_float("q4_0", (rng.standard_normal((n_kv, h_kv * d)) * 3).astype(np.float32))
    v = ggml.from_float("q8_0", rng.standard_normal((n_kv, h_kv * d)).astype(np.float32))
    mask = np.zeros((n, n_kv), dtype=np.float32)
    for t in range(n):
        mask[t, n_kv - n + t + 1:] = -np.inf  # causal, over a cache whose last n cells are these tokens
    mask[:, :2] = -np.inf  # two cells of another sequence
    scale = d ** -0.5
    out = ggml.flash_attn(q, k, v, "q4_0", "q8_0", mask.astype(np.float16), scale)
    flash_attn = {"type_k": "q4_0", "type_v": "q8_0", "scale": scale, "q": floats(q.reshape(-1)),
                  "shape": [n, h, h_kv, d, n_kv], "k": [r.tobytes().hex() for r in k],
                  "v": [r.tobytes().hex() for r in v], "mask": floats(mask.reshape(-1)), "out": floats(out.reshape(-1))}

    data = {"producer": "scripts/tools/ggml_kv_reference.py with the ggml of llama.cpp 0c1e570 (vendored by "
                        "llama-cpp-python 0.3.36, CPU build of ../shared/tools/cpu_anchor.sh, AVX2, one thread)",
            "from_float": from_float, "flash_attn": flash_attn}
    args.out.write_text(json.dumps(data) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
