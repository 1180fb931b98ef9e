"""core/llm/batched_bench.py's protocol on a recording session: the warm-up's prompt and decode step, and
a row's timing with Python's cycle collector off."""
from __future__ import annotations

import gc

from ggrun.core.llm.batched_bench import BatchedTest, run_batched, warm_up, warm_up_test


class _Recorder:
    """The part of a Session the measurement uses, recording each decode's positions and whether the
    cycle collector was on."""

    logits_on_device = False  # a CPU session: generation steps bring the logits back

    def __init__(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.calls: list[tuple[list[int], bool]] = []

    def clear(self) -> None:
        self.calls.append(([], gc.isenabled()))

    def decode(self, batch) -> None:
        self.calls.append(([int(p) for p in batch.pos], gc.isenabled()))

    def seq_cp(self, src: int, dst: int) -> None:
        pass


def test_warm_up_readies_a_decode_step_after_the_prompt():
    s = _Recorder(256)
    warm_up(s, 2048)
    assert [pos for pos, _ in s.calls] == [[], list(range(16)), [16]]


def test_a_row_warms_up_with_its_prompts_and_one_step_twice_then_a_clear_cache():
    """warm_up_test: the row's prompts (B x PP tokens, in slices of n_batch), one decode step of B tokens at
    position PP, the cache cleared before each; twice (a GPU captures a graph on its second run), then cleared."""
    s = _Recorder(4096)
    warm_up_test(s, BatchedTest(3, 5, 2), 4)
    assert [pos for pos, _ in s.calls] == [[], [0, 1, 2, 0], [1, 2], [3, 3]] * 2 + [[]]


def test_warm_up_in_a_context_the_prompt_fills_makes_no_step():
    s = _Recorder(16)
    warm_up(s, 8)
    assert [pos for pos, _ in s.calls] == [[], list(range(8)), list(range(8, 16))]


def test_a_row_is_timed_with_the_cycle_collector_off_and_restores_it():
    s = _Recorder(64)
    ticks = iter(range(10))
    res = run_batched(s, BatchedTest(4, 3, 2), 2048, clock=lambda: float(next(ticks)))
    assert [pos for pos, _ in s.calls] == [[], [0, 1, 2, 3, 0, 1, 2, 3], [4, 4], [5, 5], [6, 6]]
    assert not any(enabled for _, enabled in s.calls) and gc.isenabled()
    assert (res.t_pp, res.t_tg) == (1.0, 1.0)
