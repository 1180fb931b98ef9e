"""core.llm.bench on a synthetic tiny llama: llama-bench's arithmetic (t/s = tokens of the test /
seconds of one counted repetition) checked against an injected clock, never wall time, and the
warm-up run kept out of the figures."""
from __future__ import annotations

import statistics

import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.llm import bench
from ggrun.core.llm.bench import BenchResult, BenchTest, run_bench
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


def _session(model: Model, n_ctx: int = 16, n_batch: int = 8, n_ubatch: int = 8) -> Session:
    return Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch))


class ScriptedClock:
    """Returns the given readings in order and logs each read into a shared event list."""

    def __init__(self, readings: list[float], events: list[str]) -> None:
        self.readings = list(readings)
        self.events = events

    def __call__(self) -> float:
        self.events.append("clock")
        return self.readings.pop(0)


@pytest.fixture
def events(monkeypatch) -> list[str]:
    """Every run_once call (real, on the tiny model) is logged as 'run' in order with the clock reads."""
    log: list[str] = []
    real = bench.run_once

    def counted(session, test, rng):
        log.append("run")
        real(session, test, rng)

    monkeypatch.setattr(bench, "run_once", counted)
    return log


def test_labels_and_token_counts():
    assert (BenchTest(8, 0).label, BenchTest(8, 0).n_tokens) == ("pp8", 8)
    assert (BenchTest(0, 4).label, BenchTest(0, 4).n_tokens) == ("tg4", 4)
    assert (BenchTest(8, 4).label, BenchTest(8, 4).n_tokens) == ("pp8+tg4", 12)


@pytest.mark.parametrize("test", [BenchTest(8, 0), BenchTest(0, 4), BenchTest(8, 4)], ids=lambda t: t.label)
def test_rate_is_tokens_over_counted_seconds(tiny_model, events, test):
    """Three repetitions of 0.5 s, 0.25 s and 2 s: t/s per sample is tokens / seconds, and the
    average and deviation are those of the samples; the warm-up reads no clock."""
    readings = [10.0, 10.5, 20.0, 20.25, 30.0, 32.0]
    res = run_bench(_session(tiny_model), test, 3, clock=ScriptedClock(readings, events))

    assert events == ["run"] + ["clock", "run", "clock"] * 3  # the warm-up runs first, untimed
    assert res.samples_ns == [500_000_000, 250_000_000, 2_000_000_000]
    want = [test.n_tokens / 0.5, test.n_tokens / 0.25, test.n_tokens / 2.0]
    assert res.samples_ts == pytest.approx(want, rel=1e-12)
    assert res.avg_ts == pytest.approx(statistics.fmean(want), rel=1e-12)
    assert res.stddev_ts == pytest.approx(statistics.stdev(want), rel=1e-12)
    assert res.avg_ns == pytest.approx(statistics.fmean(res.samples_ns))
    assert res.stddev_ns == pytest.approx(statistics.stdev(res.samples_ns))


def test_without_warmup_every_run_is_timed(tiny_model, events):
    res = run_bench(_session(tiny_model), BenchTest(4, 0), 2, warmup=False,
                    clock=ScriptedClock([0.0, 1.0, 1.0, 3.0], events))
    assert events == ["clock", "run", "clock"] * 2
    assert res.samples_ts == pytest.approx([4.0, 2.0])


def test_on_rep_called_once_per_counted_repetition(tiny_model, events):
    done: list[int] = []
    run_bench(_session(tiny_model), BenchTest(0, 2), 3, clock=ScriptedClock([0, 1, 2, 3, 4, 5], events),
              on_rep=done.append)
    assert done == [0, 1, 2]
    assert events.count("run") == 4


def test_one_sample_has_no_deviation():
    res = BenchResult(BenchTest(8, 0), [1_000_000_000])
    assert res.avg_ts == 8.0 and res.stddev_ts == 0.0 and res.stddev_ns == 0.0
    empty = BenchResult(BenchTest(8, 0))
    assert empty.avg_ts == 0.0 and empty.avg_ns == 0.0


def test_each_repetition_starts_from_an_empty_cache(tiny_model):
    """run_once clears the cache, so a pp+tg test fits a context of exactly its own length every time."""
    test = BenchTest(8, 4)
    session = _session(tiny_model, n_ctx=test.n_tokens)
    res = run_bench(session, test, 2, clock=iter(range(100)).__next__)
    assert res.samples_ns == [1_000_000_000, 1_000_000_000]
    assert session.kv.n_used == test.n_tokens


def test_prompt_is_split_by_n_batch(tiny_model):
    """A 12-token prompt with -b 4 -ub 2 runs as 6 micro-batches of two tokens, then 3 one-token steps."""
    session = _session(tiny_model, n_ctx=16, n_batch=4, n_ubatch=2)
    run_bench(session, BenchTest(12, 3), 1, warmup=False)
    assert len(session.stats.reuse_log) == 6 + 3
    assert session.kv.n_used == 15


@pytest.mark.parametrize("test", [BenchTest(8, 0), BenchTest(0, 4), BenchTest(8, 4)], ids=lambda t: t.label)
def test_runs_never_re_reserve(tiny_model, test, caplog):
    """The session reserves for both worst cases (logits for all tokens, for the last only), so a
    prompt asking for its last logits, or a decode step, never grows a compute buffer mid-run."""
    session = _session(tiny_model, n_ctx=test.n_tokens, n_batch=8, n_ubatch=8)
    before = session.sched.allocators["CPU"].reserves
    run_bench(session, test, 1)
    assert session.sched.allocators["CPU"].reserves == before
    assert "re-reserving" not in caplog.text


def test_depth_in_label_and_context():
    t = BenchTest(512, 0, 512)
    assert (t.label, t.n_tokens, t.n_ctx) == ("pp512 @ d512", 512, 1024)
    assert BenchTest(8, 4, 16).label == "pp8+tg4 @ d16"


def test_depth_is_evaluated_once_and_kept(tiny_model, monkeypatch):
    """-d 6: six tokens enter the cache once, untimed; each repetition then removes only its own tokens, so
    the depth's cells stay and the prompt always starts at position 6 (llama-bench restores a saved state)."""
    evaluated: list[tuple[int, int]] = []
    real = bench.eval_prompt

    def logged(session, prompt, n_batch, seq=0, start_pos=0):
        evaluated.append((len(prompt), start_pos))
        return real(session, prompt, n_batch, seq, start_pos)

    monkeypatch.setattr(bench, "eval_prompt", logged)
    test = BenchTest(4, 2, 6)
    session = _session(tiny_model, n_ctx=test.n_ctx)
    run_bench(session, test, 3, clock=iter(range(100)).__next__)
    assert evaluated == [(6, 0)] + [(4, 6)] * 4  # the depth, the warm-up's prompt, three timed prompts
    assert session.kv.n_used == 12


def test_progress_events_are_llama_bench_phrases(tiny_model):
    said: list[str] = []
    run_bench(_session(tiny_model, n_ctx=9), BenchTest(4, 2, 3), 2, on_event=said.append)
    assert said == ["depth run 1/2", "warmup prompt run", "warmup generation run", "prompt run 1/2",
                    "generation run 1/2", "depth run 2/2 (cached)", "prompt run 2/2", "generation run 2/2"]
