"""Commands whose options are parsed into a settings record before anything runs.

A command declares its options once, on a pure function that checks them and returns a frozen record
(`settings`); `command_from` registers a Typer command with exactly those options whose body runs the
record. `parse_settings` gives the record a command line means without running anything, which is how
tests check that llama.cpp's own command lines mean the same in ggrun.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import typer

R = TypeVar("R")


def command_from(settings: Callable[..., R], run: Callable[[R], None]) -> Callable[..., None]:
    """A command callback with the options (and help) of `settings` that runs `run(settings(...))`."""

    @functools.wraps(settings)
    def command(**options) -> None:
        run(settings(**options))

    return command


def parse_settings(settings: Callable[..., R], argv: list[str]) -> R:
    """The record `settings` makes of a command line (the arguments after the command's name), parsed
    by the same option declarations as the real command; bad values raise what the command raises."""
    app = typer.Typer()
    app.command()(settings)
    command = typer.main.get_command(app)
    ctx = command.make_context("ggrun", list(argv))
    return ctx.invoke(command.callback, **ctx.params)
