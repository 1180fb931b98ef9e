"""A model's stored values checked for NaN and infinity before it runs: the float vectors (norms,
biases) at every load, since nothing downstream notices them (a NaN in a norm weight is swallowed by
the next product's 8-bit activation blocks and the model prints text), and every tensor on request
(`--check-tensors`, as llama.cpp's, which reads the whole file once)."""
from __future__ import annotations

from ggrun.core.errors import BadInput
from gguf.constants import GGMLQuantizationType as QT
from ggrun.core.quants import first_non_finite
from ggrun.loaders.gguf_file import GGUFFile

FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def check_tensor_values(gf: GGUFFile, every: bool = False) -> None:
    """BadInput naming the first tensor that holds a NaN or an infinity: among the float vectors (norms,
    biases: a few KiB each), or among all tensors (their blocks' f16 scales for quantized ones) when
    `every`."""
    for name, info in gf.tensors.items():
        vector = info.qtype in FLOAT_TYPES and len(info.shape) == 1
        if not (every or vector):
            continue
        at = first_non_finite(gf.raw(name), info.qtype)
        if at is not None:
            what = "value" if info.qtype in FLOAT_TYPES else "block scale"
            raise BadInput(f"{gf.path}: tensor {name} holds NaN or infinity ({info.qtype.name}, {what} {at}): "
                           "the file is corrupt")
