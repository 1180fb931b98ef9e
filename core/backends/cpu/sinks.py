"""Attention sinks (gpt-oss's: one more logit per head, with no value) folded into a row's online softmax
after its last cell, as ggml's flash-attention kernels fold them; the attention kernels of attention.py and
attention_tiled.py inline it, so it is one of jit.SHARED_SOURCES."""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.cpu.jit import kernel
from ggrun.core.backends.cpu.vecmath import expf


@kernel(inline="always")
def fold_sink(sink, m, total, row):
    """A row's online softmax (maximum m, sum total, unnormalised values `row`) after its last cell, given one
    more logit, sink, that carries no value: under the larger maximum, the values and the sum are rescaled
    and the sum gains the sink's share. Returns the new sum."""
    if sink > m:
        ms = expf(m - sink)
        for j in range(row.shape[0]):
            row[j] *= ms
        return total * ms + np.float32(1.0)
    return total + expf(sink - m)
