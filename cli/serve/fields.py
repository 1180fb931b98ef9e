"""A request body's fields, each read with its type and range checked: a bad one is a 400 that names it.

The sampling fields are llama-server's (temperature, top_k, top_p, min_p, seed, repeat_penalty,
repeat_last_n, presence_penalty, frequency_penalty, logit_bias, ignore_eos, stop, n_probs) with its
defaults; the OpenAI endpoints add max_tokens / max_completion_tokens, logprobs and top_logprobs,
response_format; the native /completion reads n_predict, cache_prompt, n_probs, json_schema and grammar.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ggrun.cli.serve.errors import ApiError
from ggrun.core.llm.sampling import SamplingParams

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20


def bad(message: str) -> ApiError:
    """A 400 naming what is wrong with the request."""
    return ApiError(400, message)


@dataclass
class Fields:
    """A JSON object's fields, read one by one."""

    body: dict

    @staticmethod
    def of(body: Any) -> "Fields":
        """The fields of a parsed body, which must be a JSON object."""
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return Fields(body)

    def has(self, name: str) -> bool:
        """Whether the field is given (and not null)."""
        return self.body.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        """The field's value as given, or the default when absent or null."""
        v = self.body.get(name)
        return default if v is None else v

    def bool(self, name: str, default: bool) -> bool:
        """A true/false field."""
        v = self.raw(name, default)
        if not isinstance(v, bool):
            raise bad(f"'{name}' must be true or false")
        return v

    def int(self, name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
        """An integer field within [lo, hi]."""
        v = self.raw(name, default)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(f"'{name}' must be an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(f"'{name}' {v} must lie in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]")
        return v

    def float(self, name: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
        """A finite number field within [lo, hi]."""
        v = self.raw(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad(f"'{name}' must be a finite number")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(f"'{name}' {v} must lie in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]")
        return float(v)

    def str(self, name: str, default: str | None = None) -> str | None:
        """A string field."""
        v = self.raw(name, default)
        if v is not None and not isinstance(v, str):
            raise bad(f"'{name}' must be a string")
        return v

    def dict(self, name: str) -> dict | None:
        """An object field."""
        v = self.raw(name)
        if v is not None and not isinstance(v, dict):
            raise bad(f"'{name}' must be an object")
        return v

    def stops(self) -> tuple[str, ...]:
        """`stop`: a string or a list of at most MAX_STOPS strings."""
        v = self.raw("stop", [])
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise bad("'stop' must be a string or a list of strings")
        if len(v) > MAX_STOPS:
            raise bad(f"'stop' holds {len(v)} strings; at most {MAX_STOPS}")
        return tuple(s for s in v if s)

    def sampling(self, n_vocab: int, eog: frozenset[int]) -> SamplingParams:
        """llama-server's sampling fields with its defaults; ignore_eos bans the end-of-generation tokens (a
        logit bias of minus infinity, as llama.cpp does it)."""
        bias = self.logit_bias(n_vocab)
        if self.bool("ignore_eos", False):
            bias += tuple((t, -math.inf) for t in sorted(eog))
        return SamplingParams(
            temp=self.float("temperature", 0.8, 0.0, 100.0), top_k=self.int("top_k", 40, 0, n_vocab),
            top_p=self.float("top_p", 0.95, 0.0, 1.0), min_p=self.float("min_p", 0.05, 0.0, 1.0),
            repeat_penalty=self.float("repeat_penalty", 1.0, 1e-6, 100.0),
            repeat_last_n=self.int("repeat_last_n", 64, -1, 1 << 20),
            seed=self.int("seed", -1, -(1 << 63), (1 << 64) - 1) % (1 << 32) if self.raw("seed", -1) != -1 else -1,
            presence_penalty=self.float("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=self.float("frequency_penalty", 0.0, -2.0, 2.0),
            logit_bias=bias)

    def logit_bias(self, n_vocab: int) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} or llama-server's [[id, bias], ...]; a bias of false bans the token."""
        v = self.raw("logit_bias", {})
        pairs = list(v.items()) if isinstance(v, dict) else v
        if not isinstance(pairs, list):
            raise bad("'logit_bias' must be an object of token ids to numbers")
        out = []
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise bad("'logit_bias' entries must be [token id, bias]")
            tid, b = pair
            try:
                tid = int(tid)
            except (TypeError, ValueError):
                raise bad(f"'logit_bias': token id {tid!r} is not an integer") from None
            if not 0 <= tid < n_vocab:
                raise bad(f"'logit_bias': token id {tid} is outside the vocabulary (0..{n_vocab - 1})")
            if b is False:
                b = -math.inf
            if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b):
                raise bad(f"'logit_bias': the bias of token {tid} must be a number")
            out.append((tid, float(b)))
        return tuple(out)
