"""The one error hierarchy of ggrun: the CLI maps BadInput to exit 2 and RuntimeFailure to exit 1.

Messages are single lines that name the thing at fault (a file, a tensor, an option), quoting
at most QUOTE_BYTES of a bad value (`quote`), so that a corrupt file cannot flood the terminal.
"""
from __future__ import annotations

from typing import Any

QUOTE_BYTES = 80


def quote(value: Any) -> str:
    """A value as an error message shows it: strings in quotes (escaped when they hold control
    characters), arrays by length and element type, anything longer than QUOTE_BYTES cut short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        kind = type(value[0]).__name__ if value else "item"
        return f"an array of {len(value)} {kind}s"
    if isinstance(value, float):
        text = f"{value:.7g}"
    elif isinstance(value, str):
        text = repr(value)
    else:
        text = str(value)
    data = text.encode("utf-8", "replace")
    if len(data) <= QUOTE_BYTES:
        return text
    size = len(value.encode("utf-8", "replace")) if isinstance(value, str) else len(data)
    return data[:QUOTE_BYTES].decode("utf-8", "ignore") + f"… ({size:,} bytes)"


MESSAGE_CHARS = 400


def one_line(message: str) -> str:
    """A message as the CLI prints it: line breaks folded, at most MESSAGE_CHARS characters. A last guard:
    messages quote bad values through `quote` already, so this should never have to cut."""
    text = " | ".join(part.strip() for part in message.splitlines() if part.strip())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 1] + "…"


def quote_name(text: str) -> str:
    """A name from a file (a key, a tensor) as a message shows it: as is when short and printable,
    else quoted and cut like any bad value."""
    if len(text) <= QUOTE_BYTES and text.isprintable():
        return text
    return quote(text)


class GGRunError(Exception):
    """Base of every error ggrun raises on purpose."""

    exit_code = 1


class BadInput(GGRunError):
    """The user's input is wrong: a missing or corrupt file, an impossible option, an unsupported model."""

    exit_code = 2


class RuntimeFailure(GGRunError):
    """Something failed while running although the input was valid."""

    exit_code = 1


class DeviceFailure(RuntimeFailure):
    """A device (a GPU) failed a call that ggrun made correctly: one line naming the device and its error."""

    def __init__(self, device: str, what: str) -> None:
        super().__init__(f"{device} failed: {what}")


class Interrupted(GGRunError):
    """The user asked to stop (Ctrl-C). Raised only at a safe point (a session polls before each
    micro-batch), so what was computed so far stays consistent; a command shows what it has, and the
    CLI prints `interrupted` and exits 130, as a shell does for a process that SIGINT ended."""

    exit_code = 130

    def __init__(self, message: str = "interrupted") -> None:
        super().__init__(message)


class GraphError(BadInput):
    """Bad use of the graph API: shape or dtype mismatches, naming the tensors involved."""
