"""--poll (llama.cpp's polling level of idle CPU threads, 0..100) on every command that takes -t: a bad level
is one `error:` line and exit 2 before anything loads; a good one is the level in force when the model runs."""
from __future__ import annotations

import pytest

from ggrun.core.backends.cpu import jit, threads
from tests.cli.runner import ggrun

COMMANDS = [["run", "-p", "hi", "-n", "1"], ["perplexity"], ["parallel"], ["serve"], ["bench"], ["bench", "--batched"]]
BAD = [("101", "--poll 101 must be a level from 0 to 100"), ("x", "--poll")]


@pytest.fixture
def keep_poll(monkeypatch):
    """The level a test sets is undone after it (it lives in the process, as -t does)."""
    monkeypatch.setattr(threads, "_poll", threads.poll())


@pytest.mark.parametrize("level,message", BAD, ids=["range", "not-a-number"])
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_bad_levels_exit_2_with_one_line(capsys, monkeypatch, tiny_llama_path, keep_poll, command, level, message):
    code, out, err = ggrun(capsys, monkeypatch, *command, "-m", tiny_llama_path, "--poll", level)
    assert (code, out) == (2, ""), err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.parametrize("level", [0, 7])
def test_the_level_is_in_force_when_the_model_runs(capsys, monkeypatch, tiny_llama_path, keep_poll, level):
    code, _, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "-n", "1", "--temp", "0",
                         "--poll", level)
    assert code == 0, err
    assert jit.poll() == level


def test_set_threads_refuses_a_level_out_of_range(keep_poll):
    with pytest.raises(ValueError, match="poll level 101"):
        threads.set_threads(threads.threads(), 101)
