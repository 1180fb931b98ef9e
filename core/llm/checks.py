"""Model validation before anything is allocated: every hyperparameter the architectures read is
checked for type and range, and every tensor they use for presence, shape and type, from GGUF
metadata and tensor infos alone (so `ggrun measure`, which reads no tensor data, gets it too).

Each failure is one BadInput line naming the file, the key or tensor, the value (quoted to at most
errors.QUOTE_BYTES) and what was expected. Nothing here reads tensor data or does arithmetic on a value
before its range is known.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from ggrun.core.errors import BadInput, quote, quote_name
from ggrun.core.llm.hparams import HParams
from ggrun.loaders.pretokenize import PRE_TOKENIZERS

MAX_COUNT = 1 << 16  # layers, heads, head sizes: far above any real model, far below an overflow
MAX_WIDTH = 1 << 24  # embedding and feed-forward widths
MAX_CONTEXT = 1 << 26  # trained context lengths and sliding windows (real models: up to ~10M)

@dataclass(frozen=True)
class Key:
    """One metadata key (without the `arch.` prefix) and the range its value must lie in."""

    name: str
    kind: type  # int or float
    lo: float
    hi: float
    required: bool = False
    lo_open: bool = False  # the value must be strictly above lo (a float like epsilon)
    default: Any = None  # an architecture's value when the file lacks the key
    extra: str | None = None  # the name an architecture's value has in HParams.extra (else the key's name)


# Every key HParams.from_metadata reads, for every architecture (each adds its own: Arch.keys).
COMMON_KEYS = (
    Key("context_length", int, 1, MAX_CONTEXT, required=True),
    Key("embedding_length", int, 1, MAX_WIDTH, required=True),
    Key("block_count", int, 1, MAX_COUNT, required=True),
    Key("feed_forward_length", int, 1, MAX_WIDTH, required=True),
    Key("attention.head_count", int, 1, MAX_COUNT, required=True),
    Key("attention.head_count_kv", int, 1, MAX_COUNT),
    Key("attention.key_length", int, 1, MAX_COUNT),
    Key("attention.value_length", int, 1, MAX_COUNT),
    Key("rope.dimension_count", int, 1, MAX_COUNT),
    Key("rope.freq_base", float, 0.0, math.inf, lo_open=True),
    Key("rope.scaling.factor", float, 0.0, 1e6),  # 0 means no scaling, as in llama.cpp
    Key("attention.layer_norm_rms_epsilon", float, 0.0, 1.0, lo_open=True),
    Key("vocab_size", int, 1, 1 << 31),
)

# Special token ids a value of -1 (or its uint32 form) marks as absent, as some converters write them.
NO_TOKEN = (-1, 0xFFFFFFFF)
_SPECIAL_ID = re.compile(r"tokenizer\.ggml\.[a-z_]+_token_id")

# The GGUF type of every key the GGUF spec or llama.cpp's loader fixes (llama.cpp refuses a key of any
# other type). A corrupt type code that keeps the file readable, UINT32 retyped INT32 or FLOAT32 (same
# size, so the reader stays in step), is caught here instead of read as a different number.
_STRING_KEYS = ("type", "architecture", "name", "author", "version", "organization", "finetune", "basename",
                "description", "quantized_by", "size_label", "license", "license.name", "license.link", "url",
                "doi", "uuid", "repo_url", "source.url", "source.doi", "source.uuid", "source.repo_url")
KEY_TYPES: dict[str, str] = {
    **{f"general.{k}": "STRING" for k in _STRING_KEYS},
    **{f"general.{k}": "UINT32" for k in ("quantization_version", "alignment", "file_type", "base_model.count",
                                          "dataset.count")},
    "general.tags": "ARRAY[STRING]", "general.languages": "ARRAY[STRING]",
    "tokenizer.ggml.model": "STRING", "tokenizer.ggml.pre": "STRING", "tokenizer.chat_template": "STRING",
    "tokenizer.ggml.tokens": "ARRAY[STRING]", "tokenizer.ggml.merges": "ARRAY[STRING]",
    "tokenizer.ggml.token_type": "ARRAY[INT32]", "tokenizer.ggml.scores": "ARRAY[FLOAT32]",
    **{f"tokenizer.ggml.{k}": "BOOL" for k in ("add_bos_token", "add_eos_token", "add_sep_token",
                                               "add_space_prefix", "remove_extra_whitespaces")},
}
_KEY_TYPE_PATTERNS = ((re.compile(r"general\.(base_model|dataset)\.\d+\.[a-z_]+"), "STRING"),
                      (_SPECIAL_ID, "UINT32"))

# llama.cpp's token types (llama_token_type): undefined, normal, unknown, control, user-defined, unused, byte.
TOKEN_TYPES = range(0, 7)
_TOKEN_TYPE_SET = frozenset(TOKEN_TYPES)


def _bad(gf, subject: str, value: Any, expected: str) -> BadInput:
    return BadInput(f"{gf.path}: {subject} = {quote(value)}, expected {expected}")


# ---- metadata ------------------------------------------------------------------------------------


def architecture(gf) -> str:
    """general.architecture, which must be a string to name a graph builder."""
    arch = gf.arch
    if not isinstance(arch, str):
        raise _bad(gf, "general.architecture", arch, "a string")
    return arch


def check_metadata(gf, arch_keys: Sequence[Key] = ()) -> None:
    """Types and ranges of every key the architecture (the common keys and its own) and the tokenizer
    read, before any is used."""
    arch = architecture(gf)
    for key in COMMON_KEYS + tuple(arch_keys):
        _check_key(gf, f"{arch}.{key.name}", key)
    _check_tokenizer_arrays(gf)


def expected_type(key: str, arch: str, arch_keys: Sequence[Key] = ()) -> str | None:
    """The GGUF type `key` must have, or None for a key whose type nothing fixes."""
    if key in KEY_TYPES:
        return KEY_TYPES[key]
    if key.startswith(arch + "."):
        spec = next((k for k in COMMON_KEYS + tuple(arch_keys) if f"{arch}.{k.name}" == key), None)
        if spec is not None:
            return "UINT32" if spec.kind is int else "FLOAT32"
    return next((t for pattern, t in _KEY_TYPE_PATTERNS if pattern.fullmatch(key)), None)


def _check_types(gf, arch: str, arch_keys: Sequence[Key]) -> None:
    """Every key of a fixed type has it (run after every value check, whose messages say more)."""
    types = getattr(gf, "types", {})
    for key, actual in types.items():
        want = expected_type(key, arch, arch_keys)
        if want is None or actual == want:
            continue
        if want == "UINT32" and _SPECIAL_ID.fullmatch(key) and actual == "INT32" and gf.get(key) == -1:
            continue  # -1 as INT32: an absent token, as some converters write it
        raise BadInput(f"{gf.path}: metadata key {quote_name(key)} has type {actual}, expected {want}")


def _check_key(gf, full: str, key: Key) -> None:
    value = gf.get(full)
    if value is None:
        if key.required:
            raise BadInput(f"{gf.path}: missing metadata key {full}")
        return
    if key.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(gf, full, value, "an integer")
        if not key.lo <= value <= key.hi:
            raise _bad(gf, full, value, f"an integer from {int(key.lo)} to {int(key.hi)}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(gf, full, value, "a number")
    low_ok = value > key.lo if key.lo_open else value >= key.lo
    if not (math.isfinite(value) and low_ok and value <= key.hi):
        above = "above" if key.lo_open else "at least"
        upper = "" if key.hi == math.inf else f" and at most {key.hi:g}"
        raise _bad(gf, full, value, f"a finite number {above} {key.lo:g}{upper}")


def _check_tokenizer_arrays(gf) -> None:
    """The tokenizer's arrays hold what their names say (a corrupt element type changes them into
    numbers); GGUF arrays have one element type, so the first element speaks for all."""
    for key, kind, what in (("tokenizer.ggml.tokens", str, "strings"), ("tokenizer.ggml.merges", str, "strings"),
                            ("tokenizer.ggml.token_type", int, "integers"),
                            ("tokenizer.ggml.scores", (int, float), "numbers")):
        value = gf.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not value or not isinstance(value[0], kind) \
                or isinstance(value[0], bool):
            raise _bad(gf, key, value, f"a non-empty array of {what}")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if gf.get(key) is None:
            raise BadInput(f"{gf.path}: missing metadata key {key}")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        value = gf.get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(gf, key, value, "a string")
    model = gf.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise _bad(gf, "tokenizer.ggml.model", model, "'gpt2' (BPE) or 'llama' (SentencePiece), the tokenizers "
                                                      "ggrun supports")
    pre = gf.get("tokenizer.ggml.pre") or "default"
    if model == "gpt2" and pre not in PRE_TOKENIZERS:  # a SentencePiece tokenizer has no pre-tokenizer
        raise _bad(gf, "tokenizer.ggml.pre", pre, f"one of the {len(PRE_TOKENIZERS)} pre-tokenizers ggrun knows "
                                                  "(as llama.cpp: 'default', 'llama3', 'smollm', 'qwen2', ...)")
    types = gf.get("tokenizer.ggml.token_type")
    if types is not None and not set(types) <= _TOKEN_TYPE_SET:  # one pass in C: 262k types in a few ms
        bad = next(i for i, t in enumerate(types) if t not in TOKEN_TYPES)
        raise _bad(gf, f"tokenizer.ggml.token_type[{bad}]", types[bad], "a token type from 0 to 6")
    scores = gf.get("tokenizer.ggml.scores")
    if scores is not None and not all(map(math.isfinite, scores)):
        bad = next(i for i, x in enumerate(scores) if not math.isfinite(x))
        raise _bad(gf, f"tokenizer.ggml.scores[{bad}]", scores[bad], "a finite number")


def check_hparams(gf, hp: HParams, arch_keys: Sequence[Key] = ()) -> None:
    """How the hyperparameters relate: heads that divide, head sizes that fit, one vocabulary size."""
    a = hp.arch
    if hp.n_head % hp.n_head_kv:
        raise _bad(gf, f"{a}.attention.head_count_kv", hp.n_head_kv,
                   f"a divisor of {a}.attention.head_count ({hp.n_head})")
    if gf.get(f"{a}.attention.key_length") is None and hp.n_embd % hp.n_head:
        raise _bad(gf, f"{a}.attention.head_count", hp.n_head,
                   f"a divisor of {a}.embedding_length ({hp.n_embd}) when {a}.attention.key_length is not given")
    v_len = gf.get(f"{a}.attention.value_length")
    if v_len is not None and v_len != hp.head_dim:
        raise _bad(gf, f"{a}.attention.value_length", v_len, f"the key length {hp.head_dim}")
    if hp.n_rot > hp.head_dim or hp.n_rot % 2:
        raise _bad(gf, f"{a}.rope.dimension_count", hp.n_rot, f"an even number up to the head size {hp.head_dim}")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        values = gf.get(key)
        if values is not None and len(values) < hp.n_vocab:
            raise _bad(gf, key, values, f"one entry for each of the {hp.n_vocab} tokens")
    vocab_size = gf.get(f"{a}.vocab_size")
    if vocab_size is not None and vocab_size != hp.n_vocab:
        raise _bad(gf, f"{a}.vocab_size", vocab_size, f"the vocabulary's {hp.n_vocab} tokens")
    for key, value in gf.metadata.items():
        if _SPECIAL_ID.fullmatch(key) and value not in NO_TOKEN:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < hp.n_vocab:
                raise _bad(gf, key, value, f"a token id from 0 to {hp.n_vocab - 1}")
    _check_types(gf, a, arch_keys)


# ---- tensors -------------------------------------------------------------------------------------


def check_tensors(gf, hp: HParams, layer_tensors: Sequence, required: Sequence[tuple[str, ...]]) -> None:
    """Every tensor the graph reads exists with the shape the hyperparameters give, norms are F32,
    and no block lies beyond block_count (a block_count too small would leave its tensors unplaced).

    layer_tensors: the architecture's table of per-layer tensors (archs.base.TensorSpec: name, shape, dims,
    norm), each checked where present; required: per layer, groups of names of which one must be present
    (a family may store q/k/v fused or apart)."""
    emb = ((hp.n_vocab, hp.n_embd), "[n_vocab, n_embd]")
    _check_tensor(gf, "token_embd.weight", emb)
    if "output.weight" in gf.tensors:
        _check_tensor(gf, "output.weight", emb)
    _check_tensor(gf, "output_norm.weight", ((hp.n_embd,), "[n_embd]"), norm=True)
    for il in range(hp.n_layer):
        for names in required:
            if not any(f"blk.{il}.{n}" in gf.tensors for n in names):
                gf.require_tensor(f"blk.{il}.{names[0]}")  # the one line naming the missing tensor
        for spec in layer_tensors:
            name = f"blk.{il}.{spec.name}"
            if name in gf.tensors:
                _check_tensor(gf, name, (spec.shape(hp), spec.dims), norm=spec.norm)
    for tname in gf.tensors:
        if tname.startswith("blk."):
            block = tname.split(".")[1]
            if not block.isdigit() or int(block) >= hp.n_layer:
                raise BadInput(f"{gf.path}: tensor {quote_name(tname)} lies outside blocks 0..{hp.n_layer - 1} "
                               f"({hp.arch}.block_count = {hp.n_layer})")


def _check_tensor(gf, name: str, shape: tuple[tuple[int, ...], str] | None, norm: bool = False) -> None:
    info = gf.require_tensor(name)
    if shape is not None and info.shape != shape[0]:
        raise BadInput(f"{gf.path}: tensor {name} has shape {list(info.shape)}, expected {shape[1]} = "
                       f"{list(shape[0])}")
    if norm and info.qtype.name != "F32":
        raise BadInput(f"{gf.path}: tensor {name} has type {info.qtype.name}, expected F32 (a norm weight)")
