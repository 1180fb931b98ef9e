"""cuBLAS's GEMM called through ctypes, so that a CUDA graph capture records it.

cuBLAS supports stream capture, but cupy's wrappers refuse every cuBLAS call while a stream captures
(NotImplementedError), so a prompt's products kept its split out of CUDA graphs: each of its hundreds of
launches was issued from Python on every micro-batch. These calls go to the library cupy loaded (the
same handle, found by its major version). Where it cannot be opened, `available()` is False and the
products take cupy's calls, outside graphs.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from cupy.cuda import cublas, device

V, I = ctypes.c_void_p, ctypes.c_int


class BlasError(RuntimeError):
    """A cuBLAS call through ctypes failed (its cublasStatus_t)."""


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL | None:
    """The cuBLAS library cupy loaded: opening it by its soname finds the copy already in the process."""
    version = cublas.getVersion(device.get_cublas_handle())
    major = version // 10000 if version >= 100000 else version // 1000  # 120405 (12.4.5); 11.x: 11201
    try:
        return ctypes.CDLL(f"libcublas.so.{major}")
    except OSError:
        return None


def available() -> bool:
    return _lib() is not None


def _check(what: str, status: int) -> None:
    if status:
        raise BlasError(f"{what} failed: cublasStatus_t {status}")


def gemm_ex(stream_ptr: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int, a_type: int,
            lda: int, b: int, b_type: int, ldb: int, beta: int, c: int, c_type: int, ldc: int, compute: int) -> None:
    """cublasGemmEx on the current device's handle, on stream_ptr (pointers as integers; alpha and beta in
    host memory, read as the call is issued, so a captured graph keeps their values)."""
    handle, lib = device.get_cublas_handle(), _lib()
    if lib is None:  # cupy's calls: not inside a capture (available() is False)
        cublas.setStream(handle, stream_ptr)
        cublas.gemmEx(handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc,
                      compute, cublas.CUBLAS_GEMM_DEFAULT)
        return
    _check("cublasSetStream", lib.cublasSetStream_v2(V(handle), V(stream_ptr)))
    _check("cublasGemmEx", lib.cublasGemmEx(V(handle), I(transa), I(transb), I(m), I(n), I(k), V(alpha), V(a),
                                            I(a_type), I(lda), V(b), I(b_type), I(ldb), V(beta), V(c), I(c_type),
                                            I(ldc), I(compute), I(cublas.CUBLAS_GEMM_DEFAULT)))
