"""The graph walk: nodes in an order given only by data edges, leafs, outputs, and depth."""
from __future__ import annotations

from ggrun.core import ops
from ggrun.core.dtypes import DType
from ggrun.core.graph import build_graph
from ggrun.core.tensor import Tensor, new_tensor


def _x(name: str = "x", shape=(4, 8)) -> Tensor:
    return new_tensor(name, DType.F32, shape, is_input=True)


def _check_topological(nodes: list[Tensor]) -> None:
    pos = {id(n): i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        for s in n.srcs:
            if s.op is not None:
                assert pos[id(s)] < i, f"{n.name} before its source {s.name}"
        if n.view_src is not None and n.view_src.op is not None:
            assert pos[id(n.view_src)] < i, f"view {n.name} before its root"


def test_nodes_follow_their_sources():
    x = _x()
    a = ops.silu(x)
    b = ops.scale(a, 2.0)
    c = ops.add(ops.transpose(ops.transpose(b)), a)
    g = build_graph([c])
    _check_topological(g.nodes)
    assert g.nodes[-1] is c


def test_leafs_are_the_tensors_without_an_op():
    x = _x()
    w = new_tensor("w", DType.F32, (3, 8), is_weight=True)
    out = ops.mul_mat(w, ops.silu(x))
    g = build_graph([out])
    assert set(g.leafs) == {x, w}
    assert g.inputs() == [x]
    assert all(n.op is not None for n in g.nodes)


def test_shared_sources_appear_once():
    x = _x()
    a = ops.silu(x)
    c = ops.add(ops.scale(a, 2.0), ops.scale(a, 3.0))
    g = build_graph([c])
    assert len(g.nodes) == len(set(map(id, g.nodes))) == 4
    assert g.leafs == [x]


def test_outputs_are_flagged_and_kept_in_order():
    x = _x()
    a, b = ops.silu(x), ops.gelu(x)
    g = build_graph([b, a])
    assert g.outputs == [b, a]
    assert a.is_output and b.is_output and not x.is_output


def test_order_comes_from_data_edges_not_creation_order():
    """Tensors created in one order are computed in the order the outputs need them."""
    x = _x()
    late = ops.silu(x, name="late")
    early = ops.gelu(x, name="early")
    g = build_graph([ops.add(early, late)])
    assert [n.name for n in g.nodes[:2]] == ["early", "late"]


def test_readers_of_a_cpy_result_run_after_the_write():
    cache = new_tensor("cache", DType.F32, (8, 4))
    cache.buffer = object()  # an immediate tensor (placed); the graph only needs to know it
    row = ops.silu(_x("row", (1, 4)), name="row_val")
    written = ops.cpy(row, ops.view(cache, (1, 4), offset=16), name="written")
    whole = ops.view(written, (8, 4), offset=-16, name="whole")
    reader = ops.cont(whole, name="reader")
    g = build_graph([reader])
    names = [n.name for n in g.nodes]
    assert names.index("row_val") < names.index("written") < names.index("reader")
    assert cache in g.leafs


def test_view_root_is_walked_even_when_only_the_view_is_referenced():
    """A view's dependencies include its root, so the root's producer is ordered first."""
    x = _x()
    root = ops.silu(x, name="root")
    v = ops.view(root, (2, 8), offset=2 * 8 * 4, name="v")
    g = build_graph([ops.cont(v)])
    names = [n.name for n in g.nodes]
    assert names.index("root") < names.index("v")


def test_compute_nodes_skip_pure_views():
    x = _x()
    out = ops.cont(ops.permute(ops.reshape(ops.silu(x), (2, 2, 8)), (1, 0, 2)))
    g = build_graph([out])
    assert [n.op for n in g.nodes] == ["silu", "reshape", "permute", "cont"]
    assert [n.op for n in g.compute_nodes()] == ["silu", "cont"]


def test_a_graph_deeper_than_the_recursion_limit_builds():
    t = _x()
    for _ in range(5000):
        t = ops.scale(t, 1.0)
    g = build_graph([t])
    assert len(g.nodes) == 5000
    _check_topological(g.nodes)
