"""Incremental detokenization (core/llm/detok.py): the text grown token by token equals the tokenizer's
detokenize (SmolLM2's BPE, gemma3's SPM with its space prefix), characters split over tokens are held
back, and a stop string is found where it appears, also across token boundaries."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggrun.core.llm.detok import IncrementalText
from tests.loaders.test_tokenizer import MODELS, tokenizer

TEXTS = st.text(st.characters(max_codepoint=0x2FFFF, exclude_categories=("Cs",), exclude_characters="\u2581"),
                max_size=60)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=40, deadline=None)
@given(text=TEXTS)
def test_grown_text_equals_detokenize(model: str, text: str) -> None:
    tok = tokenizer(model)
    if tok.clean_spaces:
        pytest.skip("clean_spaces is applied to whole texts only")
    ids = tok.tokenize(text, add_special=False)
    inc = IncrementalText(tok)
    pieces = [inc.add(t) for t in ids]
    assert inc.result() == tok.detokenize(ids)
    assert "".join(pieces) == inc.text and inc.n_chars == len(inc.text)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=40, deadline=None)
@given(before=TEXTS, after=TEXTS)
def test_stop_string_found_where_it_first_appears(model: str, before: str, after: str) -> None:
    tok = tokenizer(model)
    stop = "User:"
    text = before + stop + after
    inc = IncrementalText(tok, (stop, "never there \u2603"))
    for t in tok.tokenize(text, add_special=False):
        inc.add(t)
    full = tok.detokenize(tok.tokenize(text, add_special=False))
    assert inc.stop_at == full.index(stop) and inc.stop == stop
    assert inc.result() == full[:full.index(stop)]


def test_split_character_is_held_back_and_partial_stop_is_measured() -> None:
    tok = tokenizer("gemma3")
    byte_ids = [tok.token_to_id[f"<0x{b:02X}>"] for b in "😀".encode()]
    inc = IncrementalText(tok, ("<end>",))
    assert [inc.add(t) for t in byte_ids] == ["", "", "", "😀"]
    for t in tok.tokenize(" ok <en", add_special=False):
        inc.add(t)
    assert inc.stop_at < 0 and inc.partial_stop() == 3
    for t in tok.tokenize("d> more", add_special=False):
        inc.add(t)
    assert inc.text.startswith("😀 ok <end>") and inc.result() == "😀 ok "
