"""Session.reserve: buffers for the largest graph a session can run, planned once per graph that grows one."""
from __future__ import annotations

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.core.sched import Scheduler


def test_reserve_plans_again_only_the_graphs_that_grow_a_buffer(tiny_llama_path, monkeypatch):
    """Four worst cases are measured; the largest is reserved and the rest fit in it, so they are not planned
    a second time. The buffer is still the largest measured plan."""
    measured, reserved = [], []
    real_measure, real_reserve = Scheduler.measure, Scheduler.reserve
    monkeypatch.setattr(Scheduler, "measure", lambda self, sg: measured.append(real_measure(self, sg)) or measured[-1])
    monkeypatch.setattr(Scheduler, "reserve", lambda self, sg: reserved.append(sg) or real_reserve(self, sg))
    s = Session(Model.load(tiny_llama_path, [CPUBackend()]), SessionParams(n_ctx=256, n_ubatch=32))
    assert len(measured) == 4 and len(reserved) == 1
    assert s.sched.buffer_sizes()["CPU"] == max(m["CPU"].size for m in measured)
    assert s.sched.allocators["CPU"].reserves == 1
