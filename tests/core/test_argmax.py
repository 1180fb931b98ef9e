"""ops.argmax (greedy sampling in the graph) against a plain numpy formula, through the real path (graph ->
scheduler -> plan -> compute) on the CPU: rows with ties, -0 beside +0, NaN, +inf and -inf, one row and
several, odd widths, views with a row stride; and bad uses, which raise GraphError naming the tensor.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.dtypes import DType
from tests.core.harness import Runner
from tests.core.test_ops import _leaf, _raises_naming

F32, F16, I32 = DType.F32, DType.F16, DType.I32


def ref_argmax(x: np.ndarray) -> np.ndarray:
    """Each row's first index holding its largest value; -1 for a row with NaN or infinity."""
    out = []
    for row in x.astype(np.float64):
        out.append(int(np.flatnonzero(row == row.max())[0]) if np.isfinite(row).all() else -1)
    return np.array(out, dtype=np.int32)


def tricky_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Rows of few distinct values (ties everywhere); some rows poisoned with NaN, +inf or -inf (at the
    maximum's place too), some of -0 and +0 only, some of one value."""
    x = rng.integers(-3, 4, (rows, n)).astype(np.float32)
    for r in range(rows):
        kind = r % 6
        if kind == 1:
            x[r, rng.integers(n)] = np.nan
        elif kind == 2:
            x[r, rng.integers(n)] = np.inf
        elif kind == 3:
            x[r, rng.integers(n)] = -np.inf
        elif kind == 4:
            x[r] = np.where(rng.random(n) < 0.5, -0.0, 0.0)
        elif kind == 5:
            x[r] = 2.0
    return x


def run_argmax(x: np.ndarray) -> np.ndarray:
    rt = Runner()
    return rt.run1(ops.argmax(rt.input("logits", x)))


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (1, 4099), (2, 1), (3, 33), (7, 1000), (12, 257)])
def test_argmax_of_tricky_rows(shape):
    x = tricky_rows(np.random.default_rng(shape[0] * 10_000 + shape[1]), *shape)
    got = run_argmax(x)
    assert got.dtype == np.int32 and got.shape == (shape[0],)
    np.testing.assert_array_equal(got, ref_argmax(x))


@pytest.mark.parametrize("shape", [(1, 49_152), (4, 1001)])
def test_argmax_of_random_logits(shape):
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32) * 8
    np.testing.assert_array_equal(run_argmax(x), ref_argmax(x))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 500, 999])
def test_one_non_finite_value_marks_its_row_alone(value, where):
    x = np.random.default_rng(5).standard_normal((3, 1000)).astype(np.float32)
    x[1, where] = value
    got = run_argmax(x)
    assert got[1] == -1
    np.testing.assert_array_equal(got[[0, 2]], x[[0, 2]].argmax(axis=-1))


def test_argmax_of_rows_with_a_stride():
    """Rows picked from a wider tensor by a view (every other row, the first 50 columns)."""
    x = tricky_rows(np.random.default_rng(9), 8, 64)
    rt = Runner()
    a = rt.input("wide", x)
    got = rt.run1(ops.argmax(ops.view(a, (4, 50), (2 * 64 * 4, 4))))
    np.testing.assert_array_equal(got, ref_argmax(x[::2, :50]))


def test_argmax_of_no_rows():
    rt = Runner()
    x = rt.input("x", np.ones((2, 5), np.float32))
    got = rt.run1(ops.argmax(ops.view(x, (0, 5))))
    assert got.shape == (0,) and got.dtype == np.int32


@pytest.mark.parametrize("shape, dtype", [((2, 3, 4), F32), ((4,), F32), ((2, 0), F32), ((2, 4), F16),
                                          ((2, 4), I32)])
def test_argmax_takes_only_f32_rows(shape, dtype):
    with _raises_naming("logits_t"):
        ops.argmax(_leaf("logits_t", shape, dtype))
