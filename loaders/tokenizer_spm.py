"""SentencePiece BPE (tokenizer.ggml.model "llama"): merge characters by token score with <0xXX> byte
fallback, as llama.cpp's llm_tokenizer_spm_session does.

It turns one raw text fragment (spaces already escaped as "▁") into ids; it never adds BOS/EOS.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from core.errors import BadInput


class SpmEncoder:
    """Encodes text fragments with a score-ranked SentencePiece vocabulary."""

    def __init__(self, token_to_id: dict[str, int], scores: Sequence[float]) -> None:
        self.token_to_id = token_to_id
        self.scores = scores
        self._byte_ids = [self._byte_token(b) for b in range(256)]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for symbol in self._merge(list(text)):
            tid = self.token_to_id.get(symbol)
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(self._byte_ids_of(symbol))
        return ids

    def _merge(self, symbols: list[str]) -> list[str]:
        """Merge adjacent symbols into vocabulary tokens, highest score first and leftmost among equals."""
        n = len(symbols)
        if n < 2:
            return symbols
        next_ = [*range(1, n), -1]
        prev = [*range(-1, n - 1)]
        queue: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            merged = symbols[left] + symbols[right]
            tid = self.token_to_id.get(merged)
            if tid is not None:
                heapq.heappush(queue, (-self.scores[tid], left, right, len(merged)))

        for i in range(n - 1):
            push(i, i + 1)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
                continue  # outdated: one side has grown or vanished since this pair was queued
            symbols[left], symbols[right] = symbols[left] + symbols[right], ""
            next_[left] = next_[right]
            if next_[right] >= 0:
                prev[next_[right]] = left
            if prev[left] >= 0:
                push(prev[left], left)
            if next_[left] >= 0:
                push(left, next_[left])
        return [s for s in symbols if s]

    def _byte_ids_of(self, symbol: str) -> list[int]:
        ids = []
        for b in symbol.encode("utf-8", "surrogatepass"):
            tid = self._byte_ids[b]
            if tid is None:
                raise BadInput(f"SPM vocabulary has no byte token for 0x{b:02X}, needed to encode {symbol!r}")
            ids.append(tid)
        return ids

    def _byte_token(self, b: int) -> int | None:
        """llama_vocab::byte_to_token: the <0xXX> token, else the one-character token."""
        tid = self.token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self.token_to_id.get(chr(b))
        return tid
