"""Error messages stay one readable line: bad values are quoted short, the CLI's last guard folds and cuts."""
from __future__ import annotations

from ggrun.core.errors import MESSAGE_CHARS, QUOTE_BYTES, one_line, quote, quote_name


def test_quote_keeps_short_values_and_cuts_long_ones():
    assert quote(7) == "7" and quote(True) == "true" and quote(1e30) == "1e+30" and quote(float("nan")) == "nan"
    assert quote("llama") == "'llama'"
    assert quote([1, 2, 3]) == "an array of 3 ints" and quote([]) == "an array of 0 items"
    long = quote("é" * 1000)
    assert long.endswith("… (2,000 bytes)") and len(long.encode()) <= QUOTE_BYTES + 20


def test_quote_name_escapes_control_bytes():
    assert quote_name("blk.0.attn_q.weight") == "blk.0.attn_q.weight"
    assert quote_name("\x00\x00in y") == "'\\x00\\x00in y'"
    assert quote_name("k" * 300).endswith("… (300 bytes)")


def test_one_line_folds_and_caps():
    assert one_line("first\n\nsecond\n") == "first | second"
    capped = one_line("x" * 5000)
    assert len(capped) == MESSAGE_CHARS and capped.endswith("…")
