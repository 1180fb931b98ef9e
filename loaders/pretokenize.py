"""Pre-tokenizers of byte-level BPE vocabularies: split text into words exactly as llama.cpp's unicode_regex_split does.

It only splits text; it never looks up or merges tokens.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# llama.cpp's whitespace set (unicode-data.cpp); Python's \s also matches U+001C..U+001F, so it is never used.
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
                         0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

# Python's `re` has no \p{L}. So, like llama.cpp, the patterns run on a *collapsed* copy of the text in which
# every non-ASCII character is replaced by one placeholder per Unicode category (non-ASCII whitespace by \v);
# the words are then cut from the original text at the same offsets. Private-use characters are themselves
# collapsed, so a placeholder never stands for itself.
_NUMBER, _LETTER, _PUNCT, _MARK, _SYMBOL, _OTHER = "\ue001", "\ue002", "\ue003", "\ue004", "\ue005", "\ue000"
_PLACEHOLDER = {"N": _NUMBER, "L": _LETTER, "P": _PUNCT, "M": _MARK, "S": _SYMBOL}

# Character-class bodies over the collapsed text, as llama.cpp's k_ucat_map defines them for ASCII.
WS = "\t\n\x0b\x0c\r "
L = "A-Za-z" + _LETTER
N = "0-9" + _NUMBER
P = "!-#%-*,-/:;?@\\[-\\]_{}" + _PUNCT

_CONTRACTIONS_CASED = "'s|'t|'re|'ve|'m|'ll|'d"
_CONTRACTIONS_ANY_CASE = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_TRAILING_WS = f"[{WS}]+(?![^{WS}])|[{WS}]+"

# 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S) (llama.cpp's custom splitter adds |\s+)
GPT2 = f"{_CONTRACTIONS_CASED}| ?[{L}]+| ?[{N}]+| ?[^{WS}{L}{N}]+|{_TRAILING_WS}"
# (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
LLAMA3 = (f"{_CONTRACTIONS_ANY_CASE}|[^\r\n{L}{N}]?[{L}]+|[{N}]{{1,3}}| ?[^{WS}{L}{N}]+[\r\n]*"
          f"|[{WS}]*[\r\n]+|{_TRAILING_WS}")
# as LLAMA3 but single digits
QWEN2 = (f"{_CONTRACTIONS_ANY_CASE}|[^\r\n{L}{N}]?[{L}]+|[{N}]| ?[^{WS}{L}{N}]+[\r\n]*"
         f"|[{WS}]*[\r\n]+|{_TRAILING_WS}")
# gpt-4o (o200k): words split at case changes. llama.cpp spells \p{Lu}... as letters that are not a-z (an
# upper-case-ish letter; a collapsed non-ASCII letter is both) and letters that are not A-Z (lower-case-ish):
# [^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?i:'s|...)?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+
# ((?=[\p{L}])([^A-Z]))*(?i:'s|...)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
_UPPERISH = f"(?:(?=[{L}])[^a-z])"
_LOWERISH = f"(?:(?=[{L}])[^A-Z])"
GPT4O = (f"[^\r\n{L}{N}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTIONS_ANY_CASE}?"
         f"|[^\r\n{L}{N}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTIONS_ANY_CASE}?"
         f"|[{N}]{{1,3}}| ?[^{WS}{L}{N}]+[\r\n/]*|[{WS}]*[\r\n]+|{_TRAILING_WS}")
DIGIT = f"[{N}]"
DIGITS = f"[{N}]+"
PUNCT_RUN = f"[{P}$+<=>^~|]+"
THREE_ASCII_DIGITS = "[0-9][0-9][0-9]"


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type: the patterns applied in turn, and the vocab flags it sets."""

    name: str
    patterns: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False

    def split(self, text: str) -> list[str]:
        """Split text into words; each pattern splits every piece the previous one left (gaps included)."""
        collapsed = text.translate(_COLLAPSE)
        spans = [(0, len(text))]
        for pattern in self.patterns:
            spans = _split_spans(_compiled(pattern), collapsed, spans)
        return [text[start:end] for start, end in spans]


def _split_spans(regex: re.Pattern[str], collapsed: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in spans:
        pos = start
        for match in regex.finditer(collapsed, start, end):
            if match.start() > pos:
                out.append((pos, match.start()))
            out.append((match.start(), match.end()))
            pos = match.end()
        if pos < end:
            out.append((pos, end))
    return out


_REGEX_CACHE: dict[str, re.Pattern[str]] = {}


def _compiled(pattern: str) -> re.Pattern[str]:
    regex = _REGEX_CACHE.get(pattern)
    if regex is None:
        regex = _REGEX_CACHE[pattern] = re.compile(pattern)
    return regex


class _CollapseTable(dict):
    """str.translate table: ASCII stays, other characters become their category placeholder (filled lazily)."""

    def __missing__(self, codepoint: int) -> str:
        if codepoint < 128:
            value = chr(codepoint)
        elif codepoint in _WHITESPACE:
            value = "\x0b"
        else:
            value = _PLACEHOLDER.get(unicodedata.category(chr(codepoint))[0], _OTHER)
        self[codepoint] = value
        return value


_COLLAPSE = _CollapseTable()

_GPT2_LIKE = PreTokenizer("gpt2", (GPT2,))
_SMOLLM_LIKE = PreTokenizer("smollm", (DIGIT, GPT2), clean_spaces=False)
_LLAMA3_LIKE = PreTokenizer("llama3", (LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_LIKE = PreTokenizer("qwen2", (QWEN2,), clean_spaces=False)

# tokenizer.ggml.pre -> pre-tokenizer, as llama_vocab::impl::load maps them (the types implemented here).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer("default", (PUNCT_RUN, GPT2, DIGITS, THREE_ASCII_DIGITS)),
    **{name: _GPT2_LIKE for name in ("gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                                     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais",
                                     "exaone4")},
    "trillion": PreTokenizer("trillion", (GPT2,), clean_spaces=False),
    "granite-docling": PreTokenizer("granite-docling", (GPT2,), clean_spaces=False),
    **{name: _SMOLLM_LIKE for name in ("smollm", "command-r")},
    **{name: PreTokenizer(name, (DIGIT, GPT2)) for name in ("starcoder", "refact", "codeshell", "exaone",
                                                            "minerva-7b", "mellum2")},
    **{name: _LLAMA3_LIKE for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                       "midm-2.0", "lfm2", "jina-v5-nano")},
    **{name: PreTokenizer(name, (LLAMA3,)) for name in ("dbrx", "smaug-bpe")},
    **{name: _QWEN2_LIKE for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2")},
    **{name: PreTokenizer(name, (QWEN2,)) for name in ("stablelm2", "megrez")},
    **{name: PreTokenizer(name, (GPT4O,), clean_spaces=False) for name in ("gpt-4o", "llama4", "kanana2", "talkie")},
}
