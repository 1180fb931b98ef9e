"""A mixture of experts' products on the CPU (mul_mat_id): the (token, slot) pairs grouped by expert, their
quantized activation rows gathered into one block of rows per expert, and the products' rows put back in place. The
expert drivers of the product modules (mul_mat_id_* in avx2.py, portable.py, lut4_avx2.py, lut4.py, and for
repacked experts avx2_r8.py and avx512.py) compile these in around their own row kernels, so this file is one of
jit.SHARED_SOURCES.

A route is three int32 vectors (starts, used, order), views of the node's planned scratch:
- starts [n_expert + 1]: expert e's rows are gathered rows starts[e] .. starts[e + 1];
- used [n_expert + 1]: the experts chosen at least once, in expert order, their count last;
- order [tokens * slots]: gathered row j is pair order[j] (token t's slot j is pair t * slots + j).
Pairs are grouped in token order, as the reference kernel visits them, so every expert's rows are the same
whichever way its work is split. group_rows and scatter_rows are compiled apart, not inlined: numba's parallel
passes dropped a store into an array unpacked from the route tuple (numba 0.68, the count at used's end).

The work is split into tasks of one chosen expert and one of n_chunks ranges of its weight's units (rows,
or groups of rows of a repacked layout), chunk by chunk: numba's prange hands each thread a run of
consecutive tasks, so every thread reads a share of every chosen expert, whatever the experts' row counts.
"""
from __future__ import annotations

from ggrun.core.backends.cpu.jit import kernel


@kernel
def group_rows(ids, per_slot, route, xq, gq) -> None:
    """Fill route from ids [tokens, slots] (expert ids, checked) and gather the pairs' quantized activation rows
    (quant/codes.py's act_arrays: qs, d, s, sums) from xq, one row a token (per_slot False: it serves all its
    slots) or a pair, into gq [tokens * slots], grouped by expert."""
    starts, used, order = route
    n_expert = starts.shape[0] - 1
    tokens, slots = ids.shape
    for e in range(n_expert + 1):
        starts[e] = 0
    for t in range(tokens):
        for j in range(slots):
            e = ids[t, j]
            if e < 0 or e >= n_expert:
                raise IndexError("mul_mat_id: expert id out of range")
            starts[e + 1] += 1
    n_used = 0
    for e in range(n_expert):
        if starts[e + 1] > 0:
            used[n_used] = e
            n_used += 1
        starts[e + 1] += starts[e]
    used[n_expert] = n_used
    _place(ids, per_slot, route, xq, gq)


@kernel(inline="always")
def _place(ids, per_slot, route, xq, gq) -> None:
    """Each pair's row into the next free row of its expert's block (order says whose it is): starts serve
    as the cursors, then move back."""
    starts, _, order = route
    tokens, slots = ids.shape
    for t in range(tokens):
        for j in range(slots):
            e = ids[t, j]
            at = starts[e]
            starts[e] += 1
            order[at] = t * slots + j
            src = t * slots + j if per_slot else t
            _copy(xq[0][src], gq[0][at])
            _copy(xq[1][src], gq[1][at])
            _copy(xq[2][src], gq[2][at])
            _copy(xq[3][src], gq[3][at])
    n_expert = starts.shape[0] - 1
    for e in range(n_expert, 0, -1):  # each start moved to the next expert's: shift them back
        starts[e] = starts[e - 1]
    starts[0] = 0


@kernel(inline="always")
def n_tasks(route, n_chunks) -> int:
    return route[1][route[1].shape[0] - 1] * n_chunks


@kernel(inline="always")
def task(route, units, n_chunks, step, i):
    """Task i: (expert, its first and end gathered row, first and end unit of its weight); the units split
    into n_chunks ranges of `step` (the last shorter, or empty)."""
    starts, used, _ = route
    n_used = used[used.shape[0] - 1]
    c, u = i // n_used, i % n_used
    e = used[u]
    u0 = min(units, c * step)
    return e, starts[e], starts[e + 1], u0, min(units, u0 + step)


@kernel(inline="always")
def chunk_step(units, n_chunks, multiple):
    """Units a chunk, a whole number of `multiple` (the row kernels' passes)."""
    step = (units + n_chunks - 1) // n_chunks
    return (step + multiple - 1) // multiple * multiple


@kernel
def scatter_rows(og, route, out) -> None:
    """out [tokens * slots, M] row order[j] = og[j]: the gathered products back in the pairs' places."""
    order = route[2]
    for j in range(order.shape[0]):
        _copy(og[j], out[order[j]])


@kernel(inline="always")
def _copy(src, dst) -> None:
    for i in range(src.shape[0]):
        dst[i] = src[i]
