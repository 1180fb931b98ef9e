"""`ggrun serve`'s options parsed into its settings record (nothing is loaded or run): llama-server's -cb/-nocb,
and --replicas / --max-replicas / --ray-address for Ray Serve, whose bad combinations are one-line errors."""
from __future__ import annotations

import shlex

import pytest

from ggrun.cli import cmd_serve
from ggrun.cli.cmdline import parse_settings
from ggrun.core.errors import BadInput


def parse(args: str):
    """The settings record of `ggrun serve ARGS`."""
    return parse_settings(cmd_serve.settings, shlex.split(args))


def test_continuous_batching_is_on_unless_nocb():
    assert parse("-m model.gguf").cont_batching
    assert parse("-m model.gguf -cb").cont_batching
    assert not parse("-m model.gguf -nocb").cont_batching
    assert not parse("-m model.gguf --no-cont-batching").cont_batching


def test_replicas_and_their_autoscaling_bounds():
    s = parse("-m model.gguf")
    assert (s.replicas, s.max_replicas, s.ray_address) == (0, 0, None)  # one engine in this process
    s = parse("-m model.gguf --replicas 2")
    assert (s.replicas, s.max_replicas) == (2, 2)
    s = parse("-m model.gguf --replicas 2 --max-replicas 6 --ray-address auto")
    assert (s.replicas, s.max_replicas, s.ray_address) == (2, 6, "auto")


@pytest.mark.parametrize("args, message", [
    ("--replicas -1", "--replicas -1 must not be negative"),
    ("--max-replicas 4", "--max-replicas 4 needs --replicas N"),
    ("--replicas 3 --max-replicas 2", "--max-replicas 2 needs --replicas N with N <= 2"),
    ("--ray-address auto", "--ray-address needs --replicas N"),
])
def test_bad_replica_options_are_one_line_errors(args, message):
    with pytest.raises(BadInput, match=message):
        parse(f"-m model.gguf {args}")
