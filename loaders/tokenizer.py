"""Tokenizer built from GGUF metadata whose ids equal llama.cpp's (src/llama-vocab.cpp): special-token
partitioning, BOS/EOS, end-of-generation ids, pieces and detokenization, plus a UTF-8-safe stream decoder.

It reads only the plain metadata dict it is given; it never opens files or touches tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ggrun.core.errors import BadInput
from ggrun.loaders.pretokenize import PRE_TOKENIZERS
from ggrun.loaders.tokenizer_bpe import UNICODE_TO_BYTE, BpeEncoder
from ggrun.loaders.tokenizer_spm import SpmEncoder

# llama_token_attr bits
UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 2, 4, 8, 16, 32
LSTRIP, RSTRIP = 128, 256
_TYPE_TO_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}
_ATTR_OF = tuple(_TYPE_TO_ATTR.get(t, 0) for t in range(7))  # the same, indexed by type

_SPACE_ESCAPE = "\u2581"  # "▁"
_C_WHITESPACE = " \t\n\v\f\r"  # C's isspace, used when special tokens strip their neighbours

# Roles that llama.cpp reads from metadata and, when absent, guesses from token text (marking the token CONTROL).
_ROLE_KEYS = {
    "eot": ("eot_token_id",),
    "eom": ("eom_token_id",),
    "fim_pre": ("fim_pre_token_id", "prefix_token_id"),
    "fim_suf": ("fim_suf_token_id", "suffix_token_id"),
    "fim_mid": ("fim_mid_token_id", "middle_token_id"),
    "fim_pad": ("fim_pad_token_id",),
    "fim_rep": ("fim_rep_token_id",),
    "fim_sep": ("fim_sep_token_id",),
}
_ROLE_TEXTS = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss


@dataclass(frozen=True)
class _Defaults:
    """What llama.cpp assumes for a tokenizer model when the metadata does not say."""

    bos: int | None
    eos: int | None
    unk: int | None
    add_bos: bool
    add_space_prefix: bool
    clean_spaces: bool


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary ("gpt2" byte-level BPE or "llama" SentencePiece)."""

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool

    def __init__(self, md: dict[str, Any]) -> None:
        self.kind = _require(md, "tokenizer.ggml.model")
        self.tokens = _token_texts(md)
        self.n_vocab = len(self.tokens)
        self.token_to_id = _token_index(self.tokens)
        self.attrs = _token_attrs(md, self.n_vocab)
        self._encoder, defaults = self._make_encoder(md)
        self._read_flags_and_ids(md, defaults)
        self._find_eog_ids(md)
        self._special_ids = self._special_tokens_longest_first()
        self._special_groups = self._group_by_prefix(self._special_ids)
        _set_strip_attrs(md, self.tokens, self.token_to_id, self.attrs, self._special_ids)
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        return cls(md)

    # --- construction -------------------------------------------------------------------------

    def _make_encoder(self, md: dict[str, Any]) -> tuple[BpeEncoder | SpmEncoder, _Defaults]:
        if self.kind == "llama":
            encoder: BpeEncoder | SpmEncoder = SpmEncoder(self.token_to_id, _scores(md, self.n_vocab))
            return encoder, _Defaults(bos=1, eos=2, unk=0, add_bos=True, add_space_prefix=True, clean_spaces=False)
        if self.kind == "gpt2":
            pre_name = md.get("tokenizer.ggml.pre") or "default"
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise BadInput(f"unsupported pre-tokenizer tokenizer.ggml.pre = {pre_name!r}")
            encoder = BpeEncoder(self.token_to_id, _require(md, "tokenizer.ggml.merges"), pre)
            return encoder, _Defaults(bos=11, eos=11, unk=None, add_bos=pre.add_bos, add_space_prefix=False,
                                      clean_spaces=pre.clean_spaces)
        raise BadInput(f"unsupported tokenizer model tokenizer.ggml.model = {self.kind!r} (need 'gpt2' or 'llama')")

    def _read_flags_and_ids(self, md: dict[str, Any], defaults: _Defaults) -> None:
        self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", defaults.add_space_prefix))
        self.clean_spaces = defaults.clean_spaces
        self.bos_id = self._special_id(md, ("bos_token_id",), defaults.bos)
        self.eos_id = self._special_id(md, ("eos_token_id",), defaults.eos)
        self.unk_id = self._special_id(md, ("unknown_token_id",), defaults.unk)
        self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", defaults.add_bos))
        self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos and self.bos_id is None:
            raise BadInput("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        if self.add_eos and self.eos_id is None:
            raise BadInput("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

    def _special_id(self, md: dict[str, Any], keys: Sequence[str], default: int | None) -> int | None:
        """A metadata id (later keys override earlier ones), ignoring ids outside the vocabulary."""
        tid = default if default is not None and default < self.n_vocab else None
        for key in keys:
            value = md.get(f"tokenizer.ggml.{key}")
            if value is not None and 0 <= int(value) < self.n_vocab:
                tid = int(value)
        return tid

    def _find_eog_ids(self, md: dict[str, Any]) -> None:
        """llama.cpp's end-of-generation set: EOS, EOT, EOM, FIM pad/repo/sep and tokens with well-known texts."""
        roles = {role: self._special_id(md, keys, None) for role, keys in _ROLE_KEYS.items()}
        for role, texts in _ROLE_TEXTS.items():
            if roles[role] is None:
                roles[role] = self._first_token_of(texts)
                if roles[role] is not None:
                    self.attrs[roles[role]] |= CONTROL
        eog = {roles[r] for r in ("fim_pad", "fim_rep", "fim_sep") if roles[r] is not None}
        for tid in self._ids_of(_EOG_TEXTS):
            eog.add(tid)
            self.attrs[tid] |= CONTROL
        for tid in self._ids_of(_ALWAYS_RENDERED):
            self.attrs[tid] = USER_DEFINED
        eog.update(t for t in (self.eos_id, roles["eot"], roles["eom"]) if t is not None)
        self._drop_false_eog(eog)
        self.eot_id = roles["eot"]
        self.eog_ids = frozenset(eog)

    def _drop_false_eog(self, eog: set[int]) -> None:
        """Two llama.cpp workarounds: '<|end|>' is no EOG beside '<|return|>'/'<|call|>' (gpt-oss) or
        '<|calls|>'/'<|flush|>' (solar-open); '</s>' is a normal token beside '<|tool_response>' or '<|plamo:eos|>'."""
        texts = {self.tokens[t]: t for t in eog}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            eog.discard(texts["<|end|>"])
            self.attrs[texts["<|end|>"]] = USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            self.attrs[texts["</s>"]] = NORMAL

    def _first_token_of(self, texts: Iterable[str]) -> int | None:
        """The first of texts that is a token (llama.cpp takes whichever its hash map yields first)."""
        return next((self.token_to_id[t] for t in texts if t in self.token_to_id), None)

    def _ids_of(self, texts: Iterable[str]) -> list[int]:
        return sorted(self.token_to_id[t] for t in texts if t in self.token_to_id)

    def _special_tokens_longest_first(self) -> list[int]:
        """Control, user-defined and unknown tokens in the order llama.cpp's partition tries them."""
        special = list(itertools.compress(range(self.n_vocab), map((CONTROL | USER_DEFINED | UNKNOWN).__and__,
                                                                    self.attrs)))
        return sorted(special, key=self._partition_order)

    def _partition_order(self, tid: int) -> tuple[int, int]:
        # llama.cpp sorts by byte length only (std::sort, so ties fall in no defined order); ties go by id here
        return -len(self.tokens[tid].encode("utf-8")), tid

    def _group_by_prefix(self, ids: list[int]) -> dict[str, list[int]]:
        """Special tokens by their first two characters, so that a text only checks the groups it could hold."""
        groups: dict[str, list[int]] = {}
        for tid in ids:
            groups.setdefault(self.tokens[tid][:2], []).append(tid)
        return groups

    # --- tokenize -----------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of text; add_special adds BOS/EOS as the metadata asks, parse_special turns control-token
        texts into their ids (user-defined tokens are always split out, as in llama.cpp)."""
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        fragments = self._partition(text, parse_special) if text else []
        if self.kind == "llama":
            self._encode_spm(fragments, ids)
        else:
            for fragment in fragments:
                ids.extend([fragment] if isinstance(fragment, int) else self._encoder.encode(fragment))
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def _encode_spm(self, fragments: list[str | int], ids: list[int]) -> None:
        prev_special = True
        for fragment in fragments:
            if isinstance(fragment, int):
                ids.append(fragment)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                fragment = " " + fragment
            ids.extend(self._encoder.encode(fragment.replace(" ", _SPACE_ESCAPE)))
            prev_special = False

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: split out special tokens, longest first, as single ids."""
        fragments: list[str | int] = [text]
        for tid in self._specials_in(text, parse_special):
            piece = self.tokens[tid]
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or piece not in fragment:
                    split.append(fragment)
                else:
                    split.extend(self._split_on_special(fragment, tid))
            fragments = split
        return fragments

    def _specials_in(self, text: str, parse_special: bool) -> list[int]:
        """The special tokens found in text, in partition order (longest first)."""
        skipped = 0 if parse_special else CONTROL | UNKNOWN
        pairs = set(text) | {text[i:i + 2] for i in range(len(text) - 1)}
        candidates = [tid for prefix, ids in self._special_groups.items() if prefix in pairs for tid in ids]
        found = [tid for tid in candidates if not self.attrs[tid] & skipped and self.tokens[tid] in text]
        return sorted(found, key=self._partition_order)

    def _split_on_special(self, fragment: str, tid: int) -> list[str | int]:
        piece, attr = self.tokens[tid], self.attrs[tid]
        out: list[str | int] = []
        while fragment:
            at = fragment.find(piece)
            if at < 0:
                out.append(fragment)
                break
            left = fragment[:at].rstrip(_C_WHITESPACE) if attr & LSTRIP else fragment[:at]
            if left:
                out.append(left)
            out.append(tid)
            fragment = fragment[at + len(piece):]
            if attr & RSTRIP:
                fragment = fragment.lstrip(_C_WHITESPACE)
        return out

    # --- detokenize ---------------------------------------------------------------------------

    def token_to_piece(self, tid: int, special: bool = True) -> bytes:
        """The bytes of one token; control and unknown tokens give b"" unless special."""
        self._check_id(tid)
        if not special and self.attrs[tid] & (UNKNOWN | CONTROL):
            return b""
        piece = self._pieces.get(tid)
        if piece is None:
            piece = self._pieces[tid] = self._render(tid)
        return piece

    def _render(self, tid: int) -> bytes:
        text, attr = self.tokens[tid], self.attrs[tid]
        if attr & (UNKNOWN | CONTROL | USER_DEFINED):
            return text.encode("utf-8")
        if attr & NORMAL:
            if self.kind == "llama":
                return text.replace(_SPACE_ESCAPE, " ").encode("utf-8")
            return _byte_decode(text)
        if attr & BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    def detokenize(self, ids: Iterable[int], special: bool = False) -> str:
        """Text of ids (llama.cpp's llama_detokenize without removing BOS/EOS); invalid UTF-8 becomes U+FFFD."""
        out = bytearray()
        remove_space = self.add_space_prefix
        for tid in ids:
            piece = self.token_to_piece(tid, special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            out += piece
        if self.clean_spaces:
            out = clean_up_spaces(out)
        return out.decode("utf-8", "replace")

    def is_eog(self, tid: int) -> bool:
        return tid in self.eog_ids

    def _check_id(self, tid: int) -> None:
        if not 0 <= tid < self.n_vocab:
            raise BadInput(f"token id {tid} is outside the vocabulary of {self.n_vocab} tokens")


class StreamDecoder:
    """Turns generated token ids into text, yielding only whole UTF-8 characters."""

    def __init__(self, tok: Tokenizer, special: bool = False) -> None:
        self._tok = tok
        self._special = special
        self._pending = b""

    def feed(self, tid: int) -> str:
        self._pending += self._tok.token_to_piece(tid, self._special)
        cut = complete_utf8_prefix(self._pending)
        text = self._pending[:cut].decode("utf-8", "replace")
        self._pending = self._pending[cut:]
        return text

    def flush(self) -> str:
        text = self._pending.decode("utf-8", "replace")
        self._pending = b""
        return text


def complete_utf8_prefix(data: bytes) -> int:
    """Length of data without a trailing, still incomplete UTF-8 sequence."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue  # continuation byte: the lead is further back
        need = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if 0xF0 <= byte < 0xF8 else 1
        return len(data) - back if need > back else len(data)
    return len(data)


def clean_up_spaces(text: bytearray) -> bytearray:
    """llama.cpp's clean_spaces passes: drop the space before ?!., and before 's 'm 're 've, and around a lone '."""
    text = _drop_space_before(text, lambda t, i: t[i] in b"?!.,")
    text = _join_lone_apostrophes(text)
    return _drop_space_before(text, _is_contraction)


def _drop_space_before(text: bytearray, wanted: Any) -> bytearray:
    out = bytearray(text[:1])
    for i in range(1, len(text)):
        if text[i - 1] == 0x20 and wanted(text, i):
            out.pop()
        out.append(text[i])
    return out


def _is_contraction(text: bytearray, i: int) -> bool:
    if text[i] != 0x27 or i + 1 >= len(text):
        return False
    if text[i + 1] in b"sm":
        return True
    return i + 2 < len(text) and text[i + 1: i + 3] in (b"re", b"ve")


def _join_lone_apostrophes(text: bytearray) -> bytearray:
    out = bytearray(text[:1])
    i = 1
    while i < len(text):
        if text[i] == 0x27 and i + 1 < len(text) and text[i - 1] == 0x20 and text[i + 1] == 0x20:
            out.pop()
            out.append(0x27)
            text[i + 1] = 0  # llama.cpp overwrites the following space with NUL and skips it
            i += 2
            continue
        out.append(text[i])
        i += 1
    return out


def _byte_decode(text: str) -> bytes:
    """llama_decode_text: undo GPT-2 byte encoding; characters outside the table are kept visibly."""
    out = bytearray()
    for ch in text:
        b = UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def _require(md: dict[str, Any], key: str) -> Any:
    if key not in md:
        raise BadInput(f"GGUF metadata has no {key}")
    return md[key]


def _token_texts(md: dict[str, Any]) -> list[str]:
    tokens = list(_require(md, "tokenizer.ggml.tokens"))
    if all(tokens):  # the usual case, checked in one pass of C
        return tokens
    return [text if text else f"[EMPTY_{i}]" for i, text in enumerate(tokens)]


def _token_index(tokens: list[str]) -> dict[str, int]:
    index = dict(zip(tokens, range(len(tokens))))
    if len(index) != len(tokens):  # a duplicate: name the first one
        seen: dict[str, int] = {}
        for tid, text in enumerate(tokens):
            if seen.setdefault(text, tid) != tid:
                raise BadInput(f"duplicate token in vocabulary: {text!r} has ids {seen[text]} and {tid}")
    return index


def _token_attrs(md: dict[str, Any], n_vocab: int) -> list[int]:
    types = md.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * n_vocab
    if len(types) < n_vocab:
        raise BadInput(f"tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens")
    types = types[:n_vocab]
    if set(map(type, types)) <= {int} and min(types, default=0) >= 0 and max(types, default=0) < len(_ATTR_OF):
        return list(map(_ATTR_OF.__getitem__, types))  # the same mapping, looked up in C
    return [_TYPE_TO_ATTR.get(int(t), 0) for t in types]


def _scores(md: dict[str, Any], n_vocab: int) -> list[float]:
    scores = md.get("tokenizer.ggml.scores")
    if scores is None:
        return [0.0] * n_vocab
    if len(scores) < n_vocab:
        raise BadInput(f"tokenizer.ggml.scores has {len(scores)} entries for {n_vocab} tokens")
    return list(map(float, scores[:n_vocab]))


def _set_strip_attrs(md: dict[str, Any], tokens: list[str], index: dict[str, int], attrs: list[int],
                     special_ids: list[int]) -> None:
    """Per-model LSTRIP/RSTRIP that llama.cpp sets by name (phi-3, jina-v2, nomic-bert-moe, modern-bert)."""
    name = str(md.get("general.name", "")).lower()
    pre = str(md.get("tokenizer.ggml.pre", ""))
    arch = str(md.get("general.architecture", ""))

    def set_attr(text: str, bit: int, on: bool) -> None:
        if text in index:
            tid = index[text]
            attrs[tid] = attrs[tid] | bit if on else attrs[tid] & ~bit

    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
            any(a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        set_attr("<mask>", LSTRIP, True)
    elif "phi-3" in name or "phi3" in name:
        for tid in special_ids:
            attrs[tid] |= RSTRIP
        set_attr("</s>", RSTRIP, True)
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            set_attr(text, RSTRIP, False)
    elif "modern-bert" in name:
        set_attr("[MASK]", LSTRIP, True)
