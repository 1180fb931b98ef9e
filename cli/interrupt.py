"""Ctrl-C as a request to stop, one mechanism for every command: while an `Interrupt` is armed, the
first Ctrl-C only sets a flag that the session polls before each micro-batch (it then raises
core.errors.Interrupted), so the command ends at a safe point and can still show what it has:
generated text, timings, finished sequences, measured rows. A second Ctrl-C exits at once with 130.

A conversation arms it around each reply, so Ctrl-C there ends the reply and returns to the prompt.
Outside an armed stretch (loading a model, compiling kernels) Ctrl-C stops the process as usual.
"""
from __future__ import annotations

import os
import signal
from typing import Any

_NOT_INSTALLED = object()


class Interrupt:
    """A context manager that turns SIGINT into a polled flag while it is armed; calling it polls."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = _NOT_INSTALLED

    def __call__(self) -> bool:
        return self.requested

    def __enter__(self) -> Interrupt:
        self.requested = False
        try:
            previous = signal.getsignal(signal.SIGINT)
            if previous is signal.SIG_IGN:  # started with Ctrl-C ignored (a background job): leave it so
                return self
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: only it may handle signals; Ctrl-C keeps its default
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not _NOT_INSTALLED:
            signal.signal(signal.SIGINT, signal.SIG_DFL if self._previous is None else self._previous)
            self._previous = _NOT_INSTALLED

    def watch(self, session: Any) -> Any:
        """Let `session` poll this interrupt before each micro-batch; returns the session."""
        session.interrupt = self
        return session

    def _on_sigint(self, signum: int, frame: object) -> None:
        if self.requested:  # the second Ctrl-C: the user does not want to wait for a safe point
            os.write(2, b"\ninterrupted\n")
            os._exit(130)
        self.requested = True
