"""llama-bench's lists of values: an option may be repeated (`-n 0 -n 16`) and each value may be a comma
list (`-t 1,2,4`) whose integer items may be ranges, `first-last`, `first-last+step` or `first-last*mult`
(`-p 64-512*2` is 64,128,256,512), parsed as llama-bench's parse_int_range does. Bad values are one
BadInput line naming the option."""
from __future__ import annotations

import re

from ggrun.core.errors import BadInput

_RANGE = re.compile(r"(\d+)(?:-(\d+)(?:([+*|])(\d+))?)?(?:,|$)")
_RANGE_NEG = re.compile(r"(-?\d+)(?:-(\d+)(?:([+*|])(\d+))?)?(?:,|$)")


def parse_int_range(text: str, flag: str, allow_negative: bool = False) -> list[int]:
    """One value of an integer option: comma-separated integers and ranges, in order."""
    pattern = _RANGE_NEG if allow_negative else _RANGE
    out: list[int] = []
    at = 0
    while at < len(text):
        m = pattern.match(text, at)
        if m is None:
            raise BadInput(f"{flag} {text}: expected integers or ranges (first-last, first-last+step, first-last*mult)")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        op, step = m.group(3) or "+", int(m.group(4)) if m.group(4) is not None else 1
        if op == "|":
            raise BadInput(f"{flag} {text}: a range steps by +N or *N")
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise BadInput(f"{flag} {text}: the range {m.group(0).rstrip(',')} does not advance")
            i = nxt
        at = m.end()
    if not out:
        raise BadInput(f"{flag} {text!r}: no values given")
    return out


def int_values(values: list[str] | None, flag: str, default: list[int], allow_negative: bool = False,
               minimum: int | None = 0) -> tuple[int, ...]:
    """Every value of a repeatable integer option, or the default when it was not given."""
    if not values:
        return tuple(default)
    out = [v for text in values for v in parse_int_range(text, flag, allow_negative)]
    if minimum is not None and any(v < minimum for v in out):
        raise BadInput(f"{flag} {','.join(values)}: values must be at least {minimum}")
    return tuple(out)


def str_values(values: list[str] | None, default: list[str]) -> tuple[str, ...]:
    """Every comma-separated item of a repeatable string option, or the default."""
    if not values:
        return tuple(default)
    return tuple(item for text in values for item in text.split(",") if item)
