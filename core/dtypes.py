"""Element types of ggrun tensors: the computable ones (f32, f16, bf16, i32) and GGUF's
block-quantized storage types, with their byte sizes.

bf16 has no numpy dtype; it is stored as uint16 and widened by the kernels that read it.
"""
from __future__ import annotations

from enum import Enum

import numpy as np


class DType(Enum):
    """A tensor element type: (name, block size in elements, bytes per block, numpy storage dtype or None)."""

    F32 = ("f32", 1, 4, np.float32)
    F16 = ("f16", 1, 2, np.float16)
    BF16 = ("bf16", 1, 2, np.uint16)
    I32 = ("i32", 1, 4, np.int32)
    Q4_0 = ("q4_0", 32, 18, None)
    Q4_1 = ("q4_1", 32, 20, None)
    Q5_0 = ("q5_0", 32, 22, None)
    Q5_1 = ("q5_1", 32, 24, None)
    Q8_0 = ("q8_0", 32, 34, None)
    Q2_K = ("q2_k", 256, 84, None)
    Q3_K = ("q3_k", 256, 110, None)
    Q4_K = ("q4_k", 256, 144, None)
    Q5_K = ("q5_k", 256, 176, None)
    Q6_K = ("q6_k", 256, 210, None)
    IQ4_NL = ("iq4_nl", 32, 18, None)
    IQ4_XS = ("iq4_xs", 256, 136, None)
    MXFP4 = ("mxfp4", 32, 17, None)

    def __init__(self, label: str, block_size: int, type_size: int, np_dtype) -> None:
        self.label = label
        self.block_size = block_size
        self.type_size = type_size
        self.np_dtype = np.dtype(np_dtype) if np_dtype is not None else None

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    @property
    def itemsize(self) -> int:
        """Bytes per element for plain types; quantized types have no per-element size."""
        if self.is_quantized:
            raise TypeError(f"{self.label} is block-quantized and has no per-element size")
        return self.type_size

    def row_bytes(self, n: int) -> int:
        """Bytes taken by n consecutive elements (n must be whole blocks for quantized types)."""
        if n % self.block_size:
            raise ValueError(f"{n} elements is not a whole number of {self.label} blocks")
        return n // self.block_size * self.type_size

    def __str__(self) -> str:
        return self.label

    @staticmethod
    def of_ggml(type_name: str) -> "DType":
        """The DType of a GGML type, by its name in gguf's GGMLQuantizationType (e.g. 'Q4_K')."""
        return DType[type_name]


def dtype_of_numpy(dt: np.dtype) -> DType:
    """The DType that stores numpy dtype `dt` (float32, float16 or int32)."""
    for d in (DType.F32, DType.F16, DType.I32):
        if d.np_dtype == dt:
            return d
    raise TypeError(f"numpy dtype {dt} has no ggrun equivalent")
