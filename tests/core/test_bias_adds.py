"""Which adds a kernel beside them may do on the way (core/backends/bias_adds.py): the graph shapes of a bias add
after a product, a part of a grouped product, or an experts' product, as the model builders make them, are
found; every other add, however close in shape, is not (a backend would fuse it into a wrong result)."""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.backends.bias_adds import expert_bias, part_bias, row_bias
from ggrun.core.dtypes import DType
from ggrun.core.llm.blocks import expert_product
from ggrun.core.tensor import Tensor, new_tensor

F32, F16, I32, Q8 = DType.F32, DType.F16, DType.I32, DType.Q8_0


def weight(shape: tuple[int, ...], dtype: DType = F32) -> Tensor:
    return new_tensor("w", dtype, shape, is_weight=True)


def rows(*shape: int) -> Tensor:
    return new_tensor("x", F32, shape, is_input=True)


def test_a_bias_vector_after_a_product_is_found():
    w, b = weight((40, 64), Q8), weight((40,))
    p = ops.mul_mat(w, rows(3, 64))
    assert part_bias(ops.add(p, b), p, [40]) == (0, b)
    row = weight((1, 40))
    assert part_bias(ops.add(p, row), p, [40]) == (0, row)


def test_each_part_of_a_grouped_product_is_found_by_its_place():
    ws = (weight((48, 64), Q8), weight((16, 64), Q8), weight((16, 64), Q8))
    q, k, v = ops.mul_mat_multi(ws, rows(3, 64), ("q", "k", "v"))
    p = q.view_src
    for j, part in enumerate((q, k, v)):
        b = weight((part.shape[-1],))
        assert part_bias(ops.add(part, b), p, [48, 16, 16]) == (j, b)


def test_adds_that_are_not_a_bias_after_the_product_are_not_found():
    w = weight((40, 64), Q8)
    p = ops.mul_mat(w, rows(3, 64))
    other = ops.mul_mat(weight((40, 64), Q8), rows(3, 64))
    assert part_bias(ops.add(p, rows(3, 40)), p, [40]) is None  # a residual of 3 rows, not a vector
    assert part_bias(ops.add(p, p), p, [40]) is None
    assert part_bias(ops.add(other, weight((40,))), p, [40]) is None  # another product's
    assert part_bias(ops.add(p, weight((40,), F16)), p, [40]) is None  # the kernels read f32 biases
    assert part_bias(ops.add(p, weight((1,))), p, [40]) is None  # a scalar broadcast
    assert part_bias(ops.mul(p, weight((40,))), p, [40]) is None
    one = ops.mul_mat(w, rows(1, 64))
    assert part_bias(ops.add(one, ops.view(one, (40,))), one, [40]) is None  # its own memory
    ws = (weight((48, 64), Q8), weight((16, 64), Q8))
    q, k = ops.mul_mat_multi(ws, rows(3, 64), ("q", "k"))
    flat = q.view_src
    assert part_bias(ops.add(flat, flat), flat, [48, 16]) is None  # mul_mat_multi's whole result
    inner = ops.view(flat, (3, 16), offset=16 * 4)  # not where a part starts
    assert part_bias(ops.add(inner, weight((16,))), flat, [48, 16]) is None


def test_a_bias_before_a_consumer_is_found_on_any_rows():
    x, b = rows(3, 64), weight((64,))
    assert row_bias(ops.add(x, b)) is b
    assert row_bias(ops.add(b, b)) is None  # its own memory
    assert row_bias(ops.add(x, rows(3, 64))) is None


def _experts(ids: Tensor) -> Tensor:
    return ops.mul_mat_id(weight((8, 40, 64), DType.MXFP4), rows(2, 1, 64), ids)


def test_an_experts_bias_add_as_the_model_builds_it_is_found():
    w, bias = weight((8, 40, 64), DType.MXFP4), weight((8, 40))
    ids = new_tensor("ids", I32, (2, 3), is_input=True)
    add = expert_product(w, bias, rows(2, 1, 64), ids, "experts")
    y, flat_rows = add.srcs[0], add.srcs[1].view_src
    found = expert_bias(y, flat_rows, add)
    assert found is not None and found.bias is bias and found.rows is flat_rows and found.add is add


def test_other_gathers_and_adds_after_experts_are_not_found():
    all_ids = new_tensor("ids", I32, (3, 3), is_input=True)
    ids = ops.view(all_ids, (2, 3), offset=12)  # the last two tokens' ids
    y = _experts(ids)
    flat = ops.reshape(ids, (6,))

    def found(bias: Tensor, index: Tensor, second: Tensor | None = None) -> bool:
        got = ops.get_rows(bias, index)
        add = ops.add(y, second if second is not None else ops.reshape(got, y.shape))
        return expert_bias(y, got, add) is not None

    assert found(weight((8, 40)), flat)
    assert not found(weight((8, 40)), ops.reshape(ops.view(all_ids, (2, 3)), (6,)))  # the first two tokens' ids
    assert not found(weight((8, 40)), ops.reshape(new_tensor("other", I32, (2, 3), is_input=True), (6,)))
    assert not found(weight((8, 40), F16), flat)  # the kernels read f32 rows
    assert not found(weight((9, 40)), flat)  # not one row an expert
    assert not found(weight((8, 40)), flat, rows(2, 3, 40))  # the add does not read the gathered rows
