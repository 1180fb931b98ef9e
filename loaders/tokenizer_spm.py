"""SentencePiece BPE (tokenizer.ggml.model "llama"): merge characters by token score with <0xXX> byte
fallback, as llama.cpp's llm_tokenizer_spm_session does.

It turns one raw text fragment (spaces already escaped as "▁") into ids; it never adds BOS/EOS.
"""

from __future__ import annotations

from collections.abc import Sequence

from ggrun.core.errors import BadInput
from ggrun.loaders.tokenizer_bpe import merge_symbols


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
        ids, scores = self.token_to_id, self.scores

        def priority(left: str, right: str):
            tid = ids.get(left + right)
            return None if tid is None else -scores[tid]

        return merge_symbols(symbols, priority)

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
