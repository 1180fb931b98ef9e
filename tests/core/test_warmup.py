"""The CPU warm-up's selection and markers (core/backends/cpu/warmup.py): a model's tags from its weights,
the builders its tags choose, and per-builder markers, so a second model runs only the builders it adds."""
from __future__ import annotations

import numpy as np
import pytest

from ggrun.core.backends.cpu import CPUBackend, warmup
from ggrun.core.backends.cpu.matmul import REPACKED
from ggrun.core.context import ImmediateContext
from ggrun.core.dtypes import DType


def weight(ctx: ImmediateContext, name: str, dtype: DType, act_quant: bool, packed: bool):
    t = ctx.from_bytes(name, dtype, (8, 256), np.zeros(8 * dtype.row_bytes(256), np.uint8))
    if act_quant:
        t.params["act_quant"] = "q8_0"
    if packed:
        t.params[REPACKED] = np.zeros(1, np.uint8)
    return t


def test_tags_name_the_weights_products_read_and_the_tables():
    ctx = ImmediateContext(CPUBackend())
    matrices = [weight(ctx, "a", DType.Q4_1, True, True), weight(ctx, "b", DType.Q2_K, True, False),
                weight(ctx, "c", DType.F16, False, False)]
    tags = warmup.tags(matrices, [weight(ctx, "embd", DType.Q8_0, False, False)], [DType.F16, DType.Q4_0], 1)
    assert tags == {warmup.product(DType.Q4_1, True, True), warmup.product(None, True, True),
                    warmup.product(DType.Q2_K, False, True), warmup.product(None, False, True),
                    warmup.product(DType.F16, False, False), warmup.product(None, False, False),
                    warmup.rows(DType.Q8_0), warmup.kv(DType.F16), warmup.kv(DType.Q8_0)}
    assert warmup.THREADS in warmup.tags(matrices, [], [], 2)


def test_builders_are_chosen_by_their_tags():
    have = frozenset({warmup.product(DType.Q5_0, True, True), warmup.kv(DType.F16)})
    chosen = warmup.selected(have)
    assert all(w.needs <= have for w in chosen)
    assert any(w.needs == {warmup.product(DType.Q5_0, True, True)} for w in chosen)
    assert any(not w.needs for w in chosen)  # those serve every model
    assert not any(warmup.THREADS in w.needs for w in chosen)  # one thread: no parallel variants
    keys = [w.key for w in warmup.WARMS]
    assert len(set(keys)) == len(keys)


@pytest.fixture
def markers(tmp_path, monkeypatch):
    """Markers in a folder of this test's own; builders recorded instead of run."""
    ran = []
    monkeypatch.setattr(warmup, "marker_dir", lambda: tmp_path / "markers")
    monkeypatch.setattr(warmup, "run", lambda backend, w: ran.append(w))
    return ran


def test_a_second_model_runs_only_the_builders_it_adds(markers):
    first = frozenset({warmup.product(DType.Q4_1, True, True), warmup.product(None, True, True),
                       warmup.rows(DType.Q8_0), warmup.kv(DType.F16), warmup.THREADS})
    second = first | {warmup.product(DType.Q6_K, True, True)}
    assert warmup.pending(first) == warmup.selected(first)
    warmup.compile_warms(None, warmup.pending(first))
    assert markers == warmup.selected(first)
    assert warmup.pending(first) == []
    added = warmup.pending(second)
    assert added and all(warmup.product(DType.Q6_K, True, True) in w.needs for w in added)
    assert added == [w for w in warmup.selected(second) if w not in warmup.selected(first)]


def test_an_interrupted_warm_up_keeps_what_ran(markers):
    have = frozenset({warmup.product(DType.Q8_0, True, True), warmup.product(None, True, True)})
    todo = warmup.pending(have)

    def stop(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        warmup.compile_warms(None, todo, stop)
    assert warmup.pending(have) == todo[3:]


def test_markers_are_per_instruction_set(monkeypatch):
    """A run with the kernels capped to another instruction set (GGRUN_CPU_ISA) keeps markers of its own."""
    base = warmup.marker_dir()
    monkeypatch.setenv("GGRUN_CPU_ISA", "generic")
    assert warmup.marker_dir() != base and warmup.marker_dir().parent == base.parent


def test_helper_processes_share_the_builders(tmp_path, monkeypatch):
    """With a helper process, every builder runs (here or there) and is marked; the kernels it compiled come
    through numba's cache. The builders of one family run in one process."""
    monkeypatch.setattr(warmup, "marker_dir", lambda: tmp_path / "markers")
    todo = warmup.pending(frozenset({warmup.kv(DType.F16)}))
    assert len(warmup.families(todo)) > 2
    ran_here = []
    real_run = warmup.run
    monkeypatch.setattr(warmup, "run", lambda backend, w: (ran_here.append(w), real_run(backend, w)))
    warmup.compile_warms(CPUBackend(), todo, helpers=1)
    assert warmup.pending(frozenset({warmup.kv(DType.F16)})) == []
    for family in warmup.families(todo):
        here = [w in ran_here for w in family]
        assert all(here) or not any(here)
