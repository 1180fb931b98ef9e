"""Incremental detokenization: a response's text grown token by token in O(1) per token, as llama.cpp's
server does it, with its stop strings found as they appear.

Each token adds its piece's bytes; bytes that end in an incomplete UTF-8 character are held back until
the token that completes it. A stop string can only appear in the text's tail: the new text and the
len(stop) - 1 characters before it, so only that window is searched. `partial_stop` says how much of
the end of the text could still become a stop string (a streaming caller holds those characters back,
as the server does). Like the tokenizer's detokenize, the first piece loses its leading space where the
tokenizer adds one (add_space_prefix); llama.cpp's clean-up of spaces (clean_spaces) is not applied to
the stream, as the server's per-token pieces do not apply it either.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ggrun.loaders.tokenizer import complete_utf8_prefix


@dataclass
class IncrementalText:
    """The text of a sequence of tokens, grown one token at a time."""

    tokenizer: object
    stops: tuple[str, ...] = ()
    special: bool = False  # render control tokens' text (as detokenize's special)
    stop_at: int = -1  # where the first stop string found begins in the text, -1 while none
    stop: str = ""  # the stop string found
    n_tokens: int = 0
    n_chars: int = 0  # characters of text so far
    _chunks: list[str] = field(default_factory=list, repr=False)  # the text, joined only when asked
    _tail: str = field(default="", repr=False)  # its last characters, as many as a stop string could need
    _pending: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)

    @property
    def text(self) -> str:
        """The text so far (bytes of an incomplete character held back)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token: int) -> str:
        """Append a token; returns the text it completes (possibly empty) and records a stop string found."""
        piece = self.tokenizer.token_to_piece(token, self.special)
        if self.n_tokens == 0 and getattr(self.tokenizer, "add_space_prefix", False) and piece.startswith(b" "):
            piece = piece[1:]
        self.n_tokens += 1
        data = self._pending + piece
        cut = complete_utf8_prefix(data)
        self._pending = data[cut:]
        new = data[:cut].decode("utf-8", "replace")
        if new:
            self._chunks.append(new)
            if self.stops:
                window = self._tail + new
                if self.stop_at < 0:
                    self._find_stop(window, self.n_chars - len(self._tail))
                self._tail = window[-self._longest:]
            self.n_chars += len(new)
        return new

    def _find_stop(self, window: str, offset: int) -> None:
        """Look for the stop strings where one could have appeared: the new text and the characters before
        it that a stop string could reach back into (`window`, which starts at character `offset`)."""
        best = -1
        for s in self.stops:
            at = window.find(s)
            if at >= 0 and (best < 0 or at < best):
                best, self.stop = at, s
        self.stop_at = best + offset if best >= 0 else -1

    def partial_stop(self) -> int:
        """Characters at the end of the text that begin some stop string (held back when streaming)."""
        tail = self._tail
        for n in range(len(tail), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0

    def result(self) -> str:
        """The text up to the first stop string (the whole text, with held-back bytes, when none)."""
        if self.stop_at >= 0:
            return self.text[:self.stop_at]
        return self.text + self._pending.decode("utf-8", "replace")
