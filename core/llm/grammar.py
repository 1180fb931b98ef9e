"""Structured output: a JSON schema, a GBNF or Lark grammar or a regular expression enforced while sampling,
through llguidance (an optional dependency, `ggrun[serve]`).

llguidance takes any vocabulary given as the bytes of each token, so it works on a GGUF's own tokenizer
without a Hugging Face tokenizer beside it; it computes a token mask per step in tens of microseconds
(a lazily built token trie with the grammar's lexer, no precompiled automaton over the vocabulary), reads
llama.cpp's GBNF and JSON Schema as llama-server's `grammar` and `json_schema` fields give them, and is
the library llama.cpp itself can link for the same job. A row under a grammar is drawn from its logits
with every token the mask forbids removed (engine_loop.Constraint), so the text always matches it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ggrun.core.errors import BadInput
from ggrun.loaders.tokenizer import CONTROL, USER_DEFINED


def vocabulary_bytes(tok) -> list[bytes]:
    """Each token's bytes as llguidance wants them: control tokens (and user-defined ones written like
    <tag>) prefixed by 0xff, so that no grammar matches their text (llguidance's llama.cpp bridge does the same)."""
    out = []
    for tid in range(tok.n_vocab):
        piece = tok.token_to_piece(tid, True)
        attr = tok.attrs[tid]
        if attr & CONTROL or (attr & USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        out.append(piece)
    return out


class _Wrapper:
    """The tokenizer as llguidance's TokenizerWrapper reads it: ids, bytes, and a call that tokenizes bytes."""

    def __init__(self, tok) -> None:
        """Read the tokenizer's ids and every token's bytes."""
        self._tok = tok
        eog = sorted(tok.eog_ids)
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else (eog[0] if eog else 0)
        self.bos_token_id = tok.bos_id
        self.tokens = vocabulary_bytes(tok)
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.attrs[i] & CONTROL]

    def __call__(self, data: bytes) -> list[int]:
        """Tokenize bytes (llguidance's calls for literal text) without special tokens."""
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        return self._tok.tokenize(text, add_special=False, parse_special=False)


class GrammarCompiler:
    """Turns a request's schema or grammar into a fresh constraint per request; the vocabulary is read once."""

    def __init__(self, tok) -> None:
        """Build llguidance's tokenizer once: the vocabulary as bytes, the end-of-generation tokens as EOS."""
        import llguidance

        self._ll = llguidance
        self.n_vocab = tok.n_vocab
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapper(tok)), n_vocab=tok.n_vocab,
                                                eos_token=sorted(tok.eog_ids) or None)

    def json_schema(self, schema: dict | None) -> "GrammarConstraint":
        """Output that is JSON valid against `schema` (None: any JSON object)."""
        try:
            grammar = self._ll.LLMatcher.grammar_from_json_schema(json.dumps(schema if schema is not None
                                                                              else {"type": "object"}))
        except (ValueError, TypeError) as err:
            raise BadInput(f"json_schema: {err}") from None
        return self._matcher(grammar, "json_schema")

    def gbnf(self, text: str) -> "GrammarConstraint":
        """Output that a GBNF (llama.cpp's grammar format) or Lark grammar derives."""
        from llguidance._grammar_from import grammar_from

        try:
            grammar = grammar_from("grammar", text)
        except (ValueError, TypeError) as err:
            raise BadInput(f"grammar: {err}") from None
        return self._matcher(grammar, "grammar")

    def _matcher(self, grammar: str, what: str) -> "GrammarConstraint":
        """A matcher for a compiled grammar; a grammar llguidance rejects is BadInput."""
        m = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise BadInput(f"{what}: {m.get_error()}")
        return GrammarConstraint(m, self.n_vocab)


@dataclass
class GrammarConstraint:
    """One request's matcher: the tokens allowed next, advanced by each token drawn (engine_loop.Constraint)."""

    matcher: object
    n_vocab: int

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as a bool mask over the vocabulary."""
        bias = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)
        mask = np.zeros(self.n_vocab, dtype=bool)
        mask[:min(len(bias), self.n_vocab)] = bias[:self.n_vocab] != 0
        return mask

    def accept(self, token: int) -> None:
        """Advance the matcher by the token drawn."""
        self.matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and allows nothing more."""
        return bool(self.matcher.is_stopped())
