"""The crowding watch (core.backends.cpu.crowding) and the CPU backend's use of it: decode steps held on one
thread while the process's threads wait for cores, split again once a core is spare, and the same results
either way. The clock, the run-queue count and the machine's runnable count are faked: no timing."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from ggrun.core import ops
from ggrun.core.backends.cpu import CPUBackend, crowding, jit, matmul, threads
from ggrun.core.backends.cpu.backend import StepCalls, decode_step
from ggrun.core.backends.op_harness import planned, weight_data
from ggrun.core.dtypes import DType

MS = 1_000_000


class FakeMachine:
    """What the watch reads: a clock, this process's run-queue wait, other runnable threads, two CPUs."""

    def __init__(self, monkeypatch) -> None:
        self.now = self.wait = self.others = 0
        monkeypatch.setattr(crowding.time, "perf_counter_ns", lambda: self.now)
        monkeypatch.setattr(crowding, "run_queue_wait_ns", lambda: self.wait)
        monkeypatch.setattr(crowding, "others_running", lambda: self.others)
        monkeypatch.setattr(crowding, "usable_cpus", lambda: 2)

    def step(self, watch: crowding.Crowding, ms: float, waited: float) -> bool:
        """One decode step of `ms` wall time, `waited` of it runnable but not running; did it run on one thread?"""
        one = watch.one_thread(2)
        self.now += int(ms * MS)
        self.wait += int(waited * MS)
        if not one:
            watch.after_step()
        return one


def test_a_quiet_machine_keeps_splitting(monkeypatch):
    m, watch = FakeMachine(monkeypatch), crowding.Crowding()
    assert not any(m.step(watch, 15, 0.5) for _ in range(100))


def test_a_few_milliseconds_taken_now_and_then_are_no_crowd(monkeypatch):
    """A quiet machine takes a core from a step for a few milliseconds now and then (a fifth of a 13 ms step, past
    CROWDED_SHARE): no crowd, the steps keep splitting."""
    m, watch = FakeMachine(monkeypatch), crowding.Crowding()
    assert not any(m.step(watch, 13, 6.8 if i % 10 == 0 else 0.2) for i in range(100))


def test_a_crowd_holds_small_steps_until_a_core_is_spare(monkeypatch):
    m, watch = FakeMachine(monkeypatch), crowding.Crowding()
    assert not m.step(watch, 15, 12)  # the step that meets the crowd splits; the next ones do not
    m.others = 1
    assert all(m.step(watch, 20, 0) for _ in range(3 * crowding.HOLD))  # no spare core: held past the hold
    m.others = 0
    held = [m.step(watch, 20, 0) for _ in range(crowding.ROOM_STEPS)]
    assert held == [True] * (crowding.ROOM_STEPS - 1) + [False]  # the step that finds room the last time splits


def test_each_return_into_the_crowd_doubles_the_hold(monkeypatch):
    m, watch = FakeMachine(monkeypatch), crowding.Crowding()
    holds = []
    for _ in range(8):
        m.step(watch, 15, 12)
        holds.append(watch.hold)
        while m.step(watch, 15, 0):  # the machine says a core is spare, but the crowd is still there
            pass
    assert holds == [min(crowding.HOLD << i, crowding.MAX_HOLD) for i in range(8)]


def test_a_long_quiet_spell_forgets_the_crowd(monkeypatch):
    m, watch = FakeMachine(monkeypatch), crowding.Crowding()
    m.step(watch, 15, 12)
    while m.step(watch, 15, 0):
        pass
    for _ in range(20):
        m.step(watch, 15, 0)
    m.step(watch, 15, 12)
    assert watch.hold == crowding.HOLD


def test_without_the_kernels_count_steps_split(monkeypatch):
    monkeypatch.setattr(crowding, "run_queue_wait_ns", lambda: None)
    watch = crowding.Crowding()
    for _ in range(10):
        assert not watch.one_thread(2)
        watch.after_step()


def test_this_linux_gives_its_counts():
    wait, others = crowding.run_queue_wait_ns(), crowding.others_running()
    if wait is None:
        pytest.skip("no schedstat here")
    assert wait >= 0 and others is not None and others >= 0


def decode_product(lf):
    """A decode-sized product big enough to split while threads poll (a repacked Q4_K weight)."""
    m, k = 512, 1024
    data = weight_data(DType.Q4_K, m, k, 0)
    w = lf.weight("w", DType.Q4_K, (m, k), data)
    w.params["act_quant"] = "q8_k"
    if lf.ctx.backend.name == "CPU":
        packed = matmul.repack(DType.Q4_K, data)
        if packed is not None:
            w.params[matmul.REPACKED] = packed
    return ops.mul_mat(w, lf.input("x", DType.F32, np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)))


@pytest.fixture
def polling_two_threads(monkeypatch):
    before = jit.threads()
    monkeypatch.setattr(threads, "_poll", threads.DEFAULT_POLL)
    monkeypatch.setattr(matmul, "split_min_bytes", lambda: 0)
    jit.set_threads(2)
    yield
    jit.set_threads(before)


def test_a_held_step_runs_on_one_thread_and_computes_the_same(polling_two_threads):
    backend = CPUBackend()
    sched, sg, leafs, out = planned(backend, decode_product)
    for t, data in leafs.feeds.items():
        sched.set_tensor(t, data)
    calls = backend.prepare(sg.splits[0].nodes)
    assert isinstance(calls, StepCalls) and calls.decode
    seen = []
    calls.append(lambda: seen.append(numba.get_num_threads()))
    backend.crowding.start = None
    backend.run_prepared(calls)
    split = np.array(backend.array(out))
    backend.crowding.held, backend.crowding.hold = True, 10
    backend.run_prepared(calls)
    assert seen == [2, 1] and numba.get_num_threads() == 2
    assert np.array_equal(backend.array(out), split)


@pytest.mark.parametrize("rows,decode", [(1, True), (8, True), (64, False)])
def test_decode_steps_are_those_of_few_rows(rows, decode):
    _, sg, _, _ = planned(CPUBackend(), lambda lf: ops.mul_mat(
        lf.weight("w", DType.F32, (4, 8), np.ones((4, 8), np.float32)),
        lf.input("x", DType.F32, np.ones((rows, 8), np.float32))))
    assert decode_step(sg.splits[0].nodes) is decode


def test_a_split_without_products_is_not_watched():
    _, sg, _, _ = planned(CPUBackend(), lambda lf: ops.get_rows(
        lf.weight("w", DType.F32, (4, 8), np.ones((4, 8), np.float32)),
        lf.input("ids", DType.I32, np.zeros(1, np.int32))))
    assert not decode_step(sg.splits[0].nodes)
