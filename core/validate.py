"""An independent checker of memory plans: it recomputes lifetimes from the graph itself
and shares no code with the allocator, so an allocator bug cannot hide from it.

Checks: no two tensors alive at the same step share bytes (except a node computed in
place over the source it reads last), a node's scratch shares no byte with anything alive
at its step, views lie inside their roots, and outputs survive to the end.
"""
from __future__ import annotations

from dataclasses import dataclass

from ggrun.core.dtypes import DType
from ggrun.core.errors import RuntimeFailure
from ggrun.core.ops import OPS
from ggrun.core.tensor import Tensor, new_tensor


@dataclass
class _Life:
    tensor: Tensor
    born: int
    dies: int
    start: int
    end: int


def validate_plan(order: list[Tensor], offsets: dict[Tensor, int], sizes: dict[Tensor, int] | None = None,
                  scratch: dict[Tensor, tuple[int, int]] | None = None) -> int:
    """Raise RuntimeFailure naming the tensors if the placement in `offsets` (and the nodes'
    `scratch`: node -> (offset, bytes)) is unsafe for execution `order`; return the number of
    pairs checked."""
    step = {id(n): i for i, n in enumerate(order)}
    end = len(order)
    last: dict[int, int] = {}
    for i, n in enumerate(order):
        for s in n.srcs:
            r = s.root
            last[id(r)] = max(last.get(id(r), -1), i)
        if n.view_src is not None:
            # an output view's bytes are its root's: the root must survive to the end
            last[id(n.view_src)] = end if n.is_output else max(last.get(id(n.view_src), -1), i)
            _check_view(n)
    lives = []
    for t, off in offsets.items():
        born = step.get(id(t), -1)  # inputs exist before the first step
        dies = end if t.is_output else last.get(id(t), born)
        size = sizes[t] if sizes else t.nbytes
        lives.append(_Life(t, born, dies, off, off + max(size, t.nbytes)))
    for n, (off, size) in (scratch or {}).items():
        at = step[id(n)]
        lives.append(_Life(new_tensor(f"{n.name}#scratch", DType.F32, (size // 4,)), at, at, off, off + size))
    lives.sort(key=lambda x: x.start)
    checked = 0
    for i, a in enumerate(lives):
        for b in lives[i + 1:]:
            if b.start >= a.end:
                break
            checked += 1
            if a.born <= b.dies and b.born <= a.dies and not _inplace_pair(a, b):
                raise RuntimeFailure(
                    f"plan overlap: {a.tensor.describe()} [{a.start},{a.end}) steps {a.born}..{a.dies} and "
                    f"{b.tensor.describe()} [{b.start},{b.end}) steps {b.born}..{b.dies}")
    return checked


def _inplace_pair(a: _Life, b: _Life) -> bool:
    """One is a node computed in place over the other: born the step the source dies, same bytes."""
    for node, src in ((a, b), (b, a)):
        if (node.born == src.dies and src.tensor in node.tensor.srcs and OPS[node.tensor.op].inplace
                and node.start == src.start and node.tensor.nbytes == src.tensor.nbytes):
            return True
    return False


def _check_view(v: Tensor) -> None:
    root = v.view_src
    if v.view_offset < 0 or v.view_offset + v.nbytes > root.nbytes:
        raise RuntimeFailure(f"view {v.describe()} at +{v.view_offset} lies outside {root.describe()}")
