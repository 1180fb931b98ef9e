"""Bad models and numeric faults through the console entry point: a corrupt hyperparameter or tensor entry
is one `error:` line and exit 2 for `run` and `measure` alike; non-finite logits are one line and exit 1,
whatever the sampling, with the culprit node under --check-numerics; never a traceback or a numpy warning."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ggrun.loaders.synthetic import LlamaConfig, tokenizer_metadata, write_variant
from tests.cli.runner import ggrun

N_VOCAB = len(tokenizer_metadata()["tokenizer.ggml.tokens"])
LLAMA = LlamaConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=N_VOCAB, n_ctx_train=256)


def one_error_line(code: int, err: str, want_code: int, *fragments: str) -> str:
    assert code == want_code, err
    assert "Traceback" not in err and "Warning" not in err, err
    lines = [line for line in err.splitlines() if not line.startswith("ggrun: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) <= 300, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _retype_norm(tensors):
    tensors["blk.0.attn_norm.weight"] = tensors["blk.0.attn_norm.weight"].astype(np.float16)


@pytest.mark.parametrize("meta, edit, fragments", [
    ({"llama.attention.head_count": 0}, None, ["llama.attention.head_count = 0, expected an integer"]),
    ({"llama.block_count": 1}, None, ["tensor blk.1.attn_norm.weight lies outside blocks 0..0"]),
    ({"llama.rope.freq_base": float("inf")}, None, ["llama.rope.freq_base = inf"]),
    ({"tokenizer.ggml.bos_token_id": N_VOCAB}, None, [f"tokenizer.ggml.bos_token_id = {N_VOCAB}"]),
    ({}, _retype_norm, ["tensor blk.0.attn_norm.weight has type F16, expected F32"]),
])
@pytest.mark.parametrize("command", [["run", "-p", "hi", "-n", "2"], ["measure", "-c", "64"]])
def test_corrupt_models_are_one_line(capsys, monkeypatch, tmp_path, meta, edit, fragments, command):
    path = write_variant(tmp_path / "bad.gguf", LLAMA, meta=meta, edit=edit)
    code, out, err = ggrun(capsys, monkeypatch, *command, "-m", path)
    one_error_line(code, err, 2, str(path), *fragments)
    assert out == ""


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    def poison(tensors):  # a matrix: a norm weight's inf is refused at load (tests/loaders/test_tensor_values.py)
        tensors["output.weight"] = tensors["output.weight"].copy()
        tensors["output.weight"][3, 5] = np.inf
    return write_variant(tmp_path_factory.mktemp("nan") / "nan.gguf", LLAMA, edit=poison)


@pytest.mark.parametrize("sampling", [["--temp", "0"], ["--temp", "0.8", "-s", "1"]])
def test_non_finite_logits_stop_with_exit_1(capsys, monkeypatch, nan_model, sampling):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", nan_model, "-p", "hello", "-n", "4", *sampling)
    one_error_line(code, err, 1, f"{nan_model}: non-finite logits (", "while evaluating the prompt", "--check-numerics")
    assert out == ""


def test_check_numerics_names_the_node(capsys, monkeypatch, nan_model):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", nan_model, "-p", "hello", "-n", "4", "--check-numerics")
    line = one_error_line(code, err, 1, "whose weight output.weight holds inf")
    assert re.search(r"the first non-finite value \(inf\) comes from node \S*result_output ", line), line


def test_a_context_too_large_for_memory_is_bad_input(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "-n", "2", "-c", 2**31)
    one_error_line(code, err, 2, "this session needs 530.00 GiB on CPU (KV cache 530.00 GiB), ", " GiB free; lower -c or -ub")
    assert out == ""
