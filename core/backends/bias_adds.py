"""Which add nodes are bias adds that the kernel next to them can do on the way (ggml's CUDA backend fuses the
products' the same way): a bias vector broadcast over token rows (blocks.project_qkv's q/k/v biases, the output
projection's, the router's), done by the product before it as it stores its result or by the RoPE or cache
write after it as it reads its rows; or the rows of an experts' bias matrix gathered by the experts' own ids
(blocks.expert_product: get_rows, then add), done by the experts' product.

Graph shapes only: whether the arrays a backend planned for these nodes let one kernel write them all is
the backend's question. Nothing here changes a graph."""
from __future__ import annotations

from dataclasses import dataclass

from ggrun.core.dtypes import DType
from ggrun.core.tensor import Tensor

F32_BYTES = 4


def _f32_contiguous(t: Tensor) -> bool:
    return t.dtype is DType.F32 and t.is_contiguous


def row_bias(add: Tensor) -> Tensor | None:
    """The bias of `add` when it adds an f32 vector [M] (leading axes of 1) to f32 rows [..., M]: its second source,
    which must not be the memory of its first. Else None."""
    if add.op != "add" or len(add.srcs) != 2:
        return None
    rows, bias = add.srcs
    m = rows.shape[-1] if rows.shape else 0
    if (rows.dtype is not DType.F32 or rows.shape != add.shape or not _f32_contiguous(bias) or bias.root is rows.root
            or bias.n_elements != m or bias.shape[-1] != m or len(bias.shape) > len(rows.shape)):
        return None
    return bias


def part_bias(add: Tensor, product: Tensor, heights: list[int]) -> tuple[int, Tensor] | None:
    """(j, bias) when `add` is part j of `product` plus a bias vector broadcast over its token rows (row_bias):
    the product holds one [N, heights[i]] result per weight, back to back (mul_mat: one weight; mul_mat_multi:
    several), and part j, contiguous, is add's first source. Else None."""
    bias = row_bias(add)
    if bias is None or not _f32_contiguous(product):
        return None
    part = add.srcs[0]
    n = product.n_elements // max(1, sum(heights))
    starts = [n * sum(heights[:j]) for j in range(len(heights))]
    at = part.view_offset // F32_BYTES
    if part.root is not product or not part.is_contiguous or at not in starts:
        return None
    j = starts.index(at)
    if part.n_elements != n * heights[j] or part.shape[-1] != heights[j]:
        return None
    return j, bias


@dataclass(frozen=True)
class ExpertBias:
    """An experts' product's bias add: `rows` (get_rows of `bias` [n_expert, M] by the product's ids, one
    row a slot) and `add` (the product plus those rows)."""

    bias: Tensor
    rows: Tensor
    add: Tensor


def expert_bias(product: Tensor, rows: Tensor, add: Tensor) -> ExpertBias | None:
    """The bias add of an experts' product (mul_mat_id [tokens, k, M] by ids [tokens, k]) when `rows` gathers
    rows of an f32 [n_expert, M] bias by the same ids, flattened (reshape of the ids tensor itself), and `add`
    is the product plus those rows reshaped to its shape. Else None."""
    if product.op != "mul_mat_id" or rows.op != "get_rows" or add.op != "add" or len(add.srcs) != 2:
        return None
    w, _, ids = product.srcs
    bias, flat_ids = rows.srcs
    first, second = add.srcs
    n_expert, m = w.shape[0], w.shape[1]
    if (not _f32_contiguous(bias) or bias.shape != (n_expert, m) or not ids.is_contiguous
            or flat_ids.root is not ids.root or flat_ids.view_offset != ids.view_offset
            or flat_ids.shape != (ids.n_elements,) or rows.shape != (ids.n_elements, m)):
        return None
    if (first is not product or second.root is not rows or second.view_offset != 0 or not second.is_contiguous
            or second.shape != product.shape or not _f32_contiguous(product)):
        return None
    return ExpertBias(bias, rows, add)
