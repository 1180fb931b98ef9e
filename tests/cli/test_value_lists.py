"""cli.value_lists: llama-bench's value lists (parse_int_range): commas, ranges with +step and *mult,
repeated options, and one BadInput line for what llama-bench refuses."""
from __future__ import annotations

import re

import pytest

from ggrun.cli.value_lists import int_values, parse_int_range, str_values
from ggrun.core.errors import BadInput


@pytest.mark.parametrize("text, want", [
    ("512", [512]),
    ("1,2,4,8,16,32", [1, 2, 4, 8, 16, 32]),
    ("1-4", [1, 2, 3, 4]),
    ("0-512+128", [0, 128, 256, 384, 512]),
    ("64-512*2", [64, 128, 256, 512]),
    ("1-3,8,16-64*4", [1, 2, 3, 8, 16, 64]),
    ("10-20+7", [10, 17]),
    ("5-3", []),  # an empty range, as llama-bench: a value list with nothing in it is refused below
])
def test_ranges_as_llama_bench(text, want):
    if want:
        assert parse_int_range(text, "-p") == want
    else:
        with pytest.raises(BadInput, match="no values given"):
            parse_int_range(text, "-p")


@pytest.mark.parametrize("text, fragment", [
    ("x", "expected integers or ranges"),
    ("8,,9", "expected integers or ranges"),
    ("-1", "expected integers or ranges"),
    ("1-8*1", "does not advance"),
    ("1-8+0", "does not advance"),
    ("1-8|2", "steps by +N or *N"),
])
def test_bad_ranges(text, fragment):
    with pytest.raises(BadInput, match=re.escape(fragment)):
        parse_int_range(text, "-n")


def test_negative_values_where_allowed():
    assert parse_int_range("-1", "-ngl", allow_negative=True) == [-1]
    assert parse_int_range("-1,0-2", "-ngl", allow_negative=True) == [-1, 0, 1, 2]


def test_repeated_options_append_and_defaults():
    assert int_values(["0", "16"], "-n", [128]) == (0, 16)  # llama-bench: -n 0 -n 16
    assert int_values(None, "-n", [128]) == (128,)
    with pytest.raises(BadInput, match="-t 0: values must be at least 1"):
        int_values(["0"], "-t", [], minimum=1)
    assert str_values(["a.gguf,b.gguf", "c.gguf"], ["x"]) == ("a.gguf", "b.gguf", "c.gguf")
    assert str_values(None, ["x"]) == ("x",)
