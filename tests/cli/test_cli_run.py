"""`ggrun run` and `ggrun perplexity` through the console entry point (cli.app.main): bad input
gets exit code 2 and one `error:` line on stderr, never a traceback; good input prints the text
on stdout and llama.cpp-style timings on stderr. Most cases run main() in-process; two run it
in a fresh interpreter to check the real process (exit status, streams)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.loaders.synthetic import EOT, LlamaConfig, QuantizedTensor, tiny_bpe_vocab, tokenizer_metadata, write_gguf
from tests.cli.runner import ggrun, ggrun_process
from tests.llm.llama_reference import ReferenceLlama

REPO = Path(__file__).resolve().parents[2]
TIMING_LABELS = ("sampling time", "load time", "prompt eval time", "eval time", "total time", "unaccounted time",
                 "graphs reused")


def assert_bad_input(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0]
    assert out == ""


def timings(err: str) -> dict[str, str]:
    """The `ggrun: <label> = <rest>` lines of stderr by label."""
    found = {}
    for line in err.splitlines():
        m = re.match(r"ggrun:\s+([a-z ]+?)\s+=\s+(.*)$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


# ---- files that are not models ggrun can run -------------------------------------------------------


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_llama_path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    good = tiny_llama_path.read_bytes()
    files = {
        "random": d / "random.gguf",
        "header": d / "truncated-header.gguf",
        "data": d / "truncated-data.gguf",
        "empty": d / "empty.gguf",
    }
    files["random"].write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    files["header"].write_bytes(good[:200])  # inside the metadata
    files["data"].write_bytes(good[:len(good) - 4096])  # the header is whole, the last tensor is cut
    files["empty"].write_bytes(b"")

    config = LlamaConfig(n_layer=1, n_embd=32, n_head=2, n_head_kv=2, n_ff=64, n_vocab=277, n_ctx_train=64)
    tok = tokenizer_metadata()
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in config.tensor_shapes().items()}
    files["mamba"] = write_gguf(d / "mamba.gguf", "mamba", {
        k.replace("llama.", "mamba."): v for k, v in config.metadata().items()} | tok, tensors)
    # A tensor stored as IQ2_XXS, a real GGUF type that ggrun does not decode: 66 bytes per 256 values.
    iq2 = QuantizedTensor(np.zeros((config.n_vocab, 66), dtype=np.uint8), QT.IQ2_XXS)
    files["iq2_xxs"] = write_gguf(d / "iq2_xxs.gguf", "llama", config.metadata() | tok, {"token_embd.weight": iq2})
    return files


@pytest.mark.parametrize("which, fragments", [
    ("random", ["random.gguf", "not a GGUF file"]),
    ("header", ["truncated-header.gguf", "truncated GGUF header"]),
    ("data", ["truncated-data.gguf", "outside the file"]),
    ("empty", ["empty.gguf", "not a GGUF file"]),
    ("mamba", ["mamba.gguf", "architecture 'mamba' is not supported"]),
    ("iq2_xxs", ["iq2_xxs.gguf", "IQ2_XXS", "does not support"]),
])
def test_run_rejects_bad_model_file(capsys, monkeypatch, bad_files, which, fragments):
    assert_bad_input(*ggrun(capsys, monkeypatch, "run", "-m", bad_files[which], "-p", "hi", "-n", "1"), *fragments)


def test_perplexity_rejects_bad_model_file(capsys, monkeypatch, bad_files, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world")
    assert_bad_input(*ggrun(capsys, monkeypatch, "perplexity", "-m", bad_files["mamba"], "-f", text), "mamba")


def test_run_rejects_missing_model_path(capsys, monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    assert_bad_input(*ggrun(capsys, monkeypatch, "run", "-m", missing, "-p", "hi"), str(missing), "no such file")


def test_run_rejects_unknown_model_name(capsys, monkeypatch):
    assert_bad_input(*ggrun(capsys, monkeypatch, "run", "-m", "smollm3-not-a-model", "-p", "hi"),
                     "smollm3-not-a-model", "known models")


def test_run_rejects_a_directory_as_model(capsys, monkeypatch, tmp_path):
    assert_bad_input(*ggrun(capsys, monkeypatch, "run", "-m", tmp_path, "-p", "hi"), str(tmp_path))


# ---- options that cannot work -----------------------------------------------------------------------


def test_run_rejects_prompt_longer_than_context(capsys, monkeypatch, tiny_llama_path):
    # 26 letters with no merges between them: 26 tokens (the tiny tokenizer adds no BOS).
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "abcdefghijklmnopqrstuvwxyz",
                           "-c", "16", "-n", "4")
    assert_bad_input(code, out, err, "26 tokens", "-c 16")


@pytest.mark.parametrize("args, fragments", [
    (["-n", "-3"], ["-n -3"]),
    (["-ub", "0"], ["-ub 0"]),
    (["-b", "0"], ["-b 0"]),
    (["-c", "-1"], ["-c -1"]),
    (["--temp", "-1"], ["--temp"]),
    (["--top-p", "1.5"], ["--top-p"]),
    (["-f", "/nonexistent/prompt.txt"], ["/nonexistent/prompt.txt"]),
    (["--numerics", "f64"], ["--numerics f64"]),
    (["-t", "0"], ["-t 0"]),
])
def test_run_rejects_bad_option(capsys, monkeypatch, tiny_llama_path, args, fragments):
    assert_bad_input(*ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, *args), *fragments)


@pytest.mark.parametrize("args, fragments", [
    ([], ["-f"]),
    (["-f", "/nonexistent/text.txt"], ["/nonexistent/text.txt"]),
    (["-f", "TEXT", "-o", "yaml"], ["-o yaml"]),
    (["-f", "TEXT", "-ub", "0"], ["-ub 0"]),
])
def test_perplexity_rejects_bad_option(capsys, monkeypatch, tiny_llama_path, tmp_path, args, fragments):
    text = tmp_path / "t.txt"
    text.write_text("hello world, hello")
    args = [str(text) if a == "TEXT" else a for a in args]
    assert_bad_input(*ggrun(capsys, monkeypatch, "perplexity", "-m", tiny_llama_path, *args), *fragments)


def test_bad_input_in_a_real_process(bad_files):
    """The installed entry point in its own interpreter: exit status 2, one line, no traceback."""
    proc = ggrun_process("run", "-m", bad_files["random"], "-p", "hi")
    assert_bad_input(proc.returncode, proc.stdout, proc.stderr, "not a GGUF file")


# ---- runs that work ---------------------------------------------------------------------------------


def test_run_generates_text_and_prints_timings(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "-n", "4", "--temp", "0")
    assert code == 0, err
    assert "Traceback" not in err
    # "hi" is two byte tokens; greedy continuation as the independent reference computes it (it does not
    # reach the end-of-text token, so all 4 tokens come out).
    expected = ReferenceLlama.load(tiny_llama_path).greedy([ord("h"), ord("i")], 4)
    assert tiny_bpe_vocab()[0].index(EOT) not in expected
    assert out == "hi" + _text_of(expected) + "\n"  # the prompt echoed, as llama-completion does
    t = timings(err)
    assert set(TIMING_LABELS) <= set(t), err
    assert re.match(r"\s*[\d.]+ ms / +2 tokens", t["prompt eval time"])
    assert re.match(r"\s*[\d.]+ ms / +3 runs", t["eval time"])  # the first token comes from the prompt's logits
    assert re.match(r"\s*[\d.]+ ms / +5 tokens", t["total time"])  # tokens evaluated: 2 + 3
    assert re.match(r"\d+ \(built \d+\)", t["graphs reused"])


def test_run_verbose_prompt_lists_tokens(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi!", "-n", "1", "--temp", "0",
                           "--verbose-prompt")
    assert code == 0, err
    listed = re.findall(r"^\s*(\d+) -> '(.*)'$", err, flags=re.MULTILINE)
    # The tiny vocabulary's first 256 ids are the bytes themselves.
    assert listed == [("104", "h"), ("105", "i"), ("33", "!")]
    assert out.endswith("\n") and len(out) > 1


def test_run_with_zero_predict_only_evaluates_the_prompt(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hello", "-n", "0")
    assert code == 0, err
    assert out == "hello\n"
    t = timings(err)
    assert re.match(r"\s*[\d.]+ ms / +\d+ tokens", t["prompt eval time"])
    assert not re.match(r"\s*[\d.]+ ms / +0 tokens", t["prompt eval time"])
    assert re.match(r"\s*[\d.]+ ms / +0 runs", t["eval time"])
    assert t["graphs reused"].startswith("0 (built 1)")


def test_run_in_a_real_process(tiny_llama_path):
    proc = ggrun_process("run", "-m", tiny_llama_path, "-p", "hi", "-n", "4", "--temp", "0", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "hi" + _text_of(ReferenceLlama.load(tiny_llama_path).greedy([ord("h"), ord("i")], 4)) + "\n"
    assert set(TIMING_LABELS) <= set(timings(proc.stderr))


# ---- helpers ----------------------------------------------------------------------------------------


def _text_of(tokens: list[int]) -> str:
    """Text of tiny-vocabulary tokens, decoded independently of ggrun: each token is a run of GPT-2
    byte symbols; invalid UTF-8 becomes U+FFFD."""
    from ggrun.loaders.synthetic import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    vocab = tiny_bpe_vocab()[0]
    return b"".join(bytes(to_byte[c] for c in vocab[t]) for t in tokens).decode("utf-8", "replace")


@pytest.mark.parametrize("numerics", ["llama", "f32"])
def test_run_accepts_both_numerics(capsys, monkeypatch, tiny_llama_path, numerics):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hello", "-n", "3", "--temp", "0",
                           "--numerics", numerics, "-fa", "on")
    assert code == 0, err
    assert "graphs reused" in err


@pytest.mark.parametrize("args, fragment", [
    (["run", "-n", "abc"], "'-n'"),
    (["run", "--no-such-option"], "--no-such-option"),
    (["run", "-m"], "'-m'"),
])
def test_malformed_options_get_one_line_and_exit_2(capsys, monkeypatch, args, fragment):
    code, out, err = ggrun(capsys, monkeypatch, *args)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err


@pytest.mark.slow
def test_chat_wraps_the_prompt_in_the_models_template(capsys, monkeypatch, smollm2_path):
    """--chat (conversation mode) renders SmolLM2's template around -p (one turn, -st): system, user
    and assistant turns open with <|im_start|> parsed as one special id, and the model answers."""
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", smollm2_path, "--chat", "-p", "What is 2+2?", "-st",
                           "-n", "8", "--temp", "0", "--verbose-prompt", "-t", "1")
    assert code == 0, err
    pieces = re.findall(r"^\s*(\d+) -> '(.*)'$", err, flags=re.M)
    assert pieces.count(("1", "<|im_start|>")) == 3 and pieces.count(("2", "<|im_end|>")) == 2
    assert pieces[0] == ("1", "<|im_start|>")
    assert out.strip()
