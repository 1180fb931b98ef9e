"""Byte-level BPE (tokenizer.ggml.model "gpt2"): pre-tokenized words are byte-encoded and merged by rank,
as llama.cpp's llm_tokenizer_bpe_session does.

It turns raw text fragments into ids; special tokens and BOS/EOS are the caller's business.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from ggrun.loaders.pretokenize import PreTokenizer

_WORD_CACHE_LIMIT = 100_000


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable bytes map to themselves, the others to U+0100 onwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE: dict[int, str] = _byte_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {ch: b for b, ch in BYTE_TO_UNICODE.items()}
_BYTE_ENCODE = [BYTE_TO_UNICODE[b] for b in range(256)]


def byte_encode(word: str) -> str:
    """A word's UTF-8 bytes, each written as its GPT-2 stand-in character."""
    return "".join([_BYTE_ENCODE[b] for b in word.encode("utf-8", "surrogatepass")])


def parse_merges(merges: Sequence[str]) -> dict[str, int]:
    """Rank of each merge line ("left right"), the first occurrence winning; the pair (a, b) is looked up
    as a + " " + b. Byte-level symbols hold no space (byte_encode writes it as another character), so a
    pair finds exactly the line whose first space after index 0 splits it into that pair, and no line is
    split at load (a 49k-line list took 30 ms to split)."""
    return dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))  # filled last to first: first wins


class BpeEncoder:
    """Encodes text fragments with a byte-level BPE vocabulary."""

    def __init__(self, token_to_id: dict[str, int], merges: Sequence[str], pre: PreTokenizer) -> None:
        self.token_to_id = token_to_id
        self.ranks = parse_merges(merges)
        self.pre = pre
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self.pre.split(text):
            ids.extend(self._encode_word(byte_encode(word)))
        return ids

    def _encode_word(self, word: str) -> list[int]:
        cached = self._cache.get(word)
        if cached is None:
            if len(self._cache) >= _WORD_CACHE_LIMIT:
                self._cache.clear()
            cached = self._cache[word] = self._ids_of(self._merge(word))
        return cached

    def _merge(self, word: str) -> list[str]:
        if self.pre.ignore_merges and word in self.token_to_id:
            return [word]
        ranks = self.ranks
        return merge_symbols(list(word), lambda a, b: ranks.get(a + " " + b))

    def _ids_of(self, symbols: list[str]) -> list[int]:
        ids: list[int] = []
        for symbol in symbols:
            tid = self.token_to_id.get(symbol)
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(self._byte_fallback(symbol))
        return ids

    def _byte_fallback(self, symbol: str) -> list[int]:
        # llama.cpp looks each UTF-8 byte of the symbol up as a one-byte token and drops those it lacks.
        found = (self.token_to_id.get(chr(b)) for b in symbol.encode("utf-8") if b < 0x80)
        return [tid for tid in found if tid is not None]


def merge_symbols(symbols: list[str], priority: Callable[[str, str], Any]) -> list[str]:
    """Merge adjacent symbols, always the pair of lowest priority and, among equals, the leftmost.

    priority(left, right) gives a sortable key, or None when the pair does not merge. Byte-level
    BPE ranks pairs by their merge rank, SentencePiece by the merged token's score.
    """
    n = len(symbols)
    if n < 2:
        return symbols
    next_ = [*range(1, n), -1]
    prev = [*range(-1, n - 1)]
    queue: list[tuple[Any, int, int, str]] = []

    def push(left: int, right: int) -> None:
        key = priority(symbols[left], symbols[right])
        if key is not None:
            heapq.heappush(queue, (key, left, right, symbols[left] + symbols[right]))

    for i in range(n - 1):
        push(i, i + 1)
    while queue:
        _, left, right, merged = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
            continue  # outdated: one side has changed since this pair was queued
        symbols[left], symbols[right] = merged, ""
        next_[left] = next_[right]
        if next_[right] >= 0:
            prev[next_[right]] = left
        if prev[left] >= 0:
            push(prev[left], left)
        if next_[left] >= 0:
            push(left, next_[left])
    return [s for s in symbols if s]
