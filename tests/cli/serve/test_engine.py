"""The process hosting a serve engine beside its routes hands the GIL between their threads every half
millisecond (cli/serve/engine.py: share_the_gil), not at Python's default 5 ms."""
from __future__ import annotations

import sys

from ggrun.cli.serve import engine


def test_loading_an_engine_shortens_the_gil_switch_interval(monkeypatch):
    before = sys.getswitchinterval()
    calls = []
    monkeypatch.setattr(engine, "load_model", lambda *a, **k: calls.append(sys.getswitchinterval()) or 1 / 0)
    try:
        state = engine.server_state(engine.ServeSettings())
        try:
            engine.load_engine(engine.ServeSettings(), state)
        except ZeroDivisionError:
            pass
        assert calls == [engine.SWITCH_INTERVAL] and engine.SWITCH_INTERVAL < before
    finally:
        sys.setswitchinterval(before)
