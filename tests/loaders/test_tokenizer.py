"""Tokenizer ids against llama.cpp's (0c1e570) for SmolLM2 (byte-level BPE, also under other pre-tokenizers) and
gemma3 (SPM); round trips, streaming, chat templates. Vocabularies come from scripts/tools/extract_tokenizer.py fixtures."""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggrun.core.errors import BadInput
from ggrun.loaders.chat import render_chat
from ggrun.loaders.pretokenize import PRE_TOKENIZERS
from ggrun.loaders.tokenizer import StreamDecoder, Tokenizer

DATA = Path(__file__).resolve().parent.parent / "data"
MODELS = ("smollm2", "gemma3")
MODES = {  # reference key -> (add_special, parse_special)
    "bos_special": (True, True),
    "nobos_special": (False, True),
    "nobos_plain": (False, False),
}


@cache
def metadata(model: str) -> dict[str, Any]:
    with gzip.open(DATA / f"tokenizer_{model}.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


@cache
def tokenizer(model: str) -> Tokenizer:
    return Tokenizer.from_metadata(metadata(model))


@cache
def reference(model: str) -> dict[str, Any]:
    return json.loads((DATA / f"tokenize_{model}.json").read_text(encoding="utf-8"))


def reference_cases() -> list[tuple[str, str, str]]:
    return [(model, case["text"], mode) for model in MODELS for case in reference(model)["tokenize"] for mode in MODES]


@pytest.mark.parametrize(("model", "text", "mode"), reference_cases())
def test_ids_equal_llama_cpp(model: str, text: str, mode: str) -> None:
    expected = next(c[mode] for c in reference(model)["tokenize"] if c["text"] == text)
    add_special, parse_special = MODES[mode]
    assert tokenizer(model).tokenize(text, add_special=add_special, parse_special=parse_special) == expected


@cache
def smollm2_with_pre(pre: str) -> Tokenizer:
    return Tokenizer.from_metadata({**metadata("smollm2"), "tokenizer.ggml.pre": pre})


def pretype_cases() -> dict[str, list[dict[str, Any]]]:
    return json.loads((DATA / "tokenize_pretypes.json").read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "default", "gpt-4o"])
def test_other_pre_tokenizers_equal_llama_cpp(pre: str) -> None:
    """SmolLM2's vocabulary under other tokenizer.ggml.pre values, against llama.cpp (ids and cleaned-up text)."""
    tok = smollm2_with_pre(pre)
    for case in pretype_cases()[pre]:
        assert tok.tokenize(case["text"], add_special=False, parse_special=False) == case["ids"], case["text"]
        assert tok.detokenize(case["ids"]) == case["detokenized"], case["text"]


@pytest.mark.parametrize("model", MODELS)
def test_score_text_ids_equal_llama_cpp(model: str) -> None:
    ref = reference(model)["score_text"]
    assert tokenizer(model).tokenize(ref["text"]) == ref["bos_special"]


def test_vocabulary_facts() -> None:
    smol, gemma = tokenizer("smollm2"), tokenizer("gemma3")
    assert (smol.n_vocab, smol.bos_id, smol.eos_id, smol.add_bos, smol.add_eos) == (49152, 1, 2, False, False)
    assert (gemma.n_vocab, gemma.bos_id, gemma.eos_id, gemma.add_bos, gemma.add_eos) == (262144, 2, 1, True, False)
    # llama.cpp: <|endoftext|>, <|im_end|>, and <reponame> (taken for the FIM repo token)
    assert smol.eog_ids == {0, 2, 4} and smol.is_eog(2) and not smol.is_eog(1)
    # <eos>, <end_of_turn>, and the HTML "</s>" that llama.cpp's EOG text list catches
    assert gemma.eog_ids == {1, 106, 212}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("parse_special", [True, False])
def test_reference_texts_round_trip(model: str, parse_special: bool) -> None:
    tok = tokenizer(model)
    for case in reference(model)["tokenize"]:
        ids = tok.tokenize(case["text"], add_special=False, parse_special=parse_special)
        assert tok.detokenize(ids, special=True) == case["text"]


# Characters that survive a round trip: SmolLM2 lacks a few control bytes and the lead bytes 0xF1-0xF7
# (code points from U+40000), which llama.cpp then drops; SPM reads "▁" as the space it escapes.
ROUND_TRIP_TEXT = st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",),
                                        exclude_characters="\x04\x06\x13\x14\x16\x1d\u2581"), max_size=40)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=60, deadline=None)
@given(text=ROUND_TRIP_TEXT)
def test_any_text_round_trips(model: str, text: str) -> None:
    tok = tokenizer(model)
    assert tok.detokenize(tok.tokenize(text, add_special=False), special=True) == text


def test_detokenize_hides_control_tokens_unless_special() -> None:
    tok = tokenizer("smollm2")
    ids = tok.tokenize("<|im_start|>user\nHi<|im_end|>")
    assert tok.detokenize(ids) == "user\nHi"
    assert tok.token_to_piece(2, special=False) == b""
    assert tok.token_to_piece(2) == b"<|im_end|>"


def test_stream_decoder_holds_emoji_split_over_byte_tokens() -> None:
    tok = tokenizer("gemma3")
    byte_ids = [tok.token_to_id[f"<0x{b:02X}>"] for b in "😀".encode()]
    decoder = StreamDecoder(tok)
    assert [decoder.feed(tid) for tid in byte_ids] == ["", "", "", "😀"]
    assert decoder.flush() == ""


@pytest.mark.parametrize("model", MODELS)
def test_stream_decoder_emits_only_whole_characters(model: str) -> None:
    tok = tokenizer(model)
    text = "Emoji: 😀👍🏽🚀 ❤️ CJK: 你好世界 Ελληνικά"
    ids = tok.tokenize(text, add_special=False)
    decoder = StreamDecoder(tok)
    chunks = [decoder.feed(tid) for tid in ids] + [decoder.flush()]
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) == text
    assert len(chunks) > 4 and "" in chunks  # some characters did span several tokens


def test_stream_decoder_flushes_an_unfinished_character() -> None:
    tok = tokenizer("gemma3")
    decoder = StreamDecoder(tok)
    assert decoder.feed(tok.token_to_id["<0xE4>"]) == ""
    assert decoder.flush() == "\ufffd"


def test_smollm2_chat_template_for_one_user_message() -> None:
    template = metadata("smollm2")["tokenizer.chat_template"]
    prompt = render_chat(template, [{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer("smollm2").tokenize(prompt)[:1] == [1]  # <|im_start|> parsed as one id


def test_chat_template_errors_are_bad_input() -> None:
    with pytest.raises(BadInput, match="no system role"):
        render_chat("{{ raise_exception('no system role') }}", [])
    with pytest.raises(BadInput, match="chat template error"):
        render_chat("{% for m in messages %}", [])
    with pytest.raises(BadInput, match="unsafe"):
        render_chat("{{ messages.__class__.__mro__ }}", [])


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("tokenizer.ggml.model", "bert", "unsupported tokenizer model"),
    ("tokenizer.ggml.pre", "no-such-pre", "unsupported pre-tokenizer"),
])
def test_unsupported_metadata_is_bad_input(key: str, value: str, problem: str) -> None:
    with pytest.raises(BadInput, match=problem):
        Tokenizer.from_metadata({**metadata("smollm2"), key: value})


PRE_SPLITS = {  # pre-tokenizer -> text -> words (byte-level BPE regexes as llama.cpp applies them)
    "gpt2": {"Hello world's 12345!!\n\n  x": ["Hello", " world", "'s", " 12345", "!!", "\n\n ", " x"]},
    "smollm": {"abc 123 it'S": ["abc", " ", "1", "2", "3", " it", "'", "S"]},
    "llama3": {"Hello world's 12345!!\n\n  x": ["Hello", " world", "'s", " ", "123", "45", "!!\n\n", " ", " x"]},
    "qwen2": {"it'S 12": ["it", "'S", " ", "1", "2"]},
    "default": {"a+b=12345, ok": ["a", "+", "b", "=", "123", "45", ",", " ok"]},
}


@pytest.mark.parametrize(("pre", "text"), [(p, t) for p, cases in PRE_SPLITS.items() for t in cases])
def test_pre_tokenizer_splits(pre: str, text: str) -> None:
    assert PRE_TOKENIZERS[pre].split(text) == PRE_SPLITS[pre][text]
