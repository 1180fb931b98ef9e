"""ops.sample on the GPU: sample.cu's sample_rows, a block per row of logits, writing only the token ids.

The kernel lists each row's entries the logit bias and the penalties change (ids and values, in the
op's scratch) and flags them in a bitmap of the vocabulary in shared memory, beside the keys its select
gathers; a vocabulary whose bitmap does not fit (above SAMPLE_MAX_VOCAB) runs the shared array kernel instead. A row of more top-k candidates
than the kernel sorts (SK_MAX) is marked ops.SAMPLE_ON_HOST for the session to sample on the host.
"""
from __future__ import annotations

import numpy as np

from ggrun.core.backends.cuda.binding import Launch, binds, i32, i64, launch_step, ptr, rows_of
from ggrun.core.backends.cuda.module import kernel
from ggrun.core.tensor import Tensor

SAMPLE_THREADS = 1024  # sample.cu's ST
SAMPLE_MAX_VOCAB = 320 * 1024  # flags of the vocabulary in 40 KiB of shared memory, beside 13 KiB of the kernel's
GATHER_BYTES = 4096 * 8  # sample.cu's L_CAP keys gathered beside the flags (its first histogram before them)


def _listed(node: Tensor) -> int:
    """Entries a row's bias and penalties may change: its recent tokens and bias ids."""
    return node.srcs[3].shape[1] + node.srcs[4].shape[1]


def _sample_scratch(node: Tensor) -> int:
    return node.shape[0] * _listed(node) * 8


@binds("sample", scratch=_sample_scratch)
def _sample(node: Tensor, out, srcs, scratch, backend):
    logits, params, draws, recent, bias_ids, bias_vals = srcs
    a = rows_of(logits)
    if a is None or not all(x.flags.c_contiguous for x in (params, draws, recent, bias_ids, bias_vals, out)):
        return None
    rows, n, ld = a
    if n > SAMPLE_MAX_VOCAB:
        return None
    ids_at = int(ptr(scratch))
    vals_at = np.uint64(ids_at + rows * _listed(node) * 4)
    args = (ptr(logits), i64(ld), i32(n), ptr(params), ptr(draws), ptr(recent), i32(recent.shape[1]), ptr(bias_ids),
            ptr(bias_vals), i32(bias_ids.shape[1]), np.uint64(ids_at), vals_at, ptr(out))
    smem = -(-n // 64) * 8 + GATHER_BYTES
    fn = kernel("sample.cu", "sample_rows")
    fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, smem)
    return launch_step(node.op, Launch(fn, (rows,), (SAMPLE_THREADS,), args, smem))
