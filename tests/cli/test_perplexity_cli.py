"""`ggrun perplexity` on a tiny synthetic llama: llama-perplexity's output lines exactly (`[1]x,[2]y,...`,
`Final estimate: PPL = X +/- Y`, the --kl-divergence table and statistics), their values against the
independent reference forward pass, JSON, the saved log-probability file, and bad input as one line."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from ggrun.core.llm.kl_divergence import LogProbReader
from ggrun.loaders.synthetic import write_tiny_llama
from tests.cli.runner import ggrun
from tests.llm.llama_reference import ReferenceLlama

TEXT = "the world is in the hello world of the tiny model, and hello again to the world. " * 6


@pytest.fixture(scope="module")
def bos_llama(tmp_path_factory):
    """The tiny llama with add_bos on, so that each chunk starts with BOS as llama-perplexity makes it."""
    return write_tiny_llama(tmp_path_factory.mktemp("bos") / "tiny-bos.gguf", weight_type=QT.F32,
                            extra_metadata={"tokenizer.ggml.add_bos_token": True})


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT + "\n", encoding="utf-8")  # the trailing newline is dropped, as llama.cpp's -f does
    return path


def tokens_of(path, text: str) -> list[int]:
    from ggrun.loaders.gguf_file import open_gguf
    from ggrun.loaders.tokenizer import Tokenizer

    with open_gguf(path) as f:
        return Tokenizer.from_metadata(f.metadata).tokenize(text, add_special=True, parse_special=False)


def reference_nll(path, tokens: list[int], n_ctx: int, n_chunks: int) -> list[np.ndarray]:
    """Each chunk's scored nll by the float64 reference: BOS in place of the first token, second half."""
    ref = ReferenceLlama.load(path)
    bos = tokens[0]
    out = []
    for i in range(n_chunks):
        window = tokens[i * n_ctx:(i + 1) * n_ctx]
        logits = ref.logits([bos] + window[1:]).astype(np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        first = n_ctx // 2
        out.append(-lp[np.arange(first, n_ctx - 1), window[first + 1:]])
    return out


def test_text_output_is_llama_perplexity_lines(capsys, monkeypatch, bos_llama, text_file):
    code, out, err = ggrun(capsys, monkeypatch, "perplexity", "-m", bos_llama, "-f", text_file, "-c", "32")
    assert code == 0, err
    tokens = tokens_of(bos_llama, TEXT)
    n_chunks = len(tokens) // 32
    assert n_chunks >= 3
    progress, final = out.splitlines()
    assert re.fullmatch(r"(\[\d+\]\d+\.\d{4},)+", progress)
    assert re.fullmatch(r"Final estimate: PPL = \d+\.\d{4} \+/- \d+\.\d{5}", final)
    nll = reference_nll(bos_llama, tokens, 32, n_chunks)
    running = [float(x) for x in re.findall(r"\[\d+\]([\d.]+),", progress)]
    assert [int(x) for x in re.findall(r"\[(\d+)\]", progress)] == list(range(1, n_chunks + 1))
    want = [math.exp(np.concatenate(nll[:i + 1]).mean()) for i in range(n_chunks)]
    assert running == pytest.approx(want, rel=2e-3)  # f16 KV cache, as the CLI uses
    allv = np.concatenate(nll)
    ppl, unc = re.fullmatch(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", final).groups()
    assert float(ppl) == pytest.approx(math.exp(allv.mean()), rel=2e-3)
    assert float(unc) == pytest.approx(math.exp(allv.mean()) * math.sqrt(allv.var() / (len(allv) - 1)), rel=2e-2)
    assert f"calculating perplexity over {n_chunks} chunks, n_ctx=32" in err


def test_json_output_and_chunk_limit(capsys, monkeypatch, bos_llama, text_file):
    code, out, err = ggrun(capsys, monkeypatch, "perplexity", "-m", bos_llama, "-f", text_file, "-c", "32",
                           "--chunks", "2", "-b", "8", "-o", "json")
    assert code == 0, err
    rec = json.loads(out)
    assert (rec["n_ctx"], rec["n_chunks"], rec["n_tokens"]) == (32, 2, 2 * 15)
    assert len(rec["chunks"]) == 2 and rec["chunks"][-1] == pytest.approx(rec["perplexity"])
    nll = np.concatenate(reference_nll(bos_llama, tokens_of(bos_llama, TEXT), 32, 2))
    assert rec["perplexity"] == pytest.approx(math.exp(nll.mean()), rel=2e-3)
    assert rec["uncertainty"] > 0


def test_kl_divergence_of_a_model_against_its_own_saved_run(capsys, monkeypatch, bos_llama, text_file, tmp_path):
    base = tmp_path / "base.kld"
    code, out, err = ggrun(capsys, monkeypatch, "perplexity", "-m", bos_llama, "-f", text_file, "-c", "32",
                           "--kl-divergence-base", base)
    assert code == 0, err
    ppl = float(re.search(r"PPL = ([\d.]+)", out).group(1))
    saved = LogProbReader(base)
    tokens = tokens_of(bos_llama, TEXT)
    assert (saved.n_ctx, saved.n_chunks) == (32, len(tokens) // 32)
    assert list(saved.tokens) == tokens[:saved.n_ctx * saved.n_chunks]
    ties = [_tied_tops(saved.chunk(c), saved.n_vocab) for c in range(saved.n_chunks)]
    saved.close()

    code, out, err = ggrun(capsys, monkeypatch, "perplexity", "-m", bos_llama, "--kl-divergence-base", base,
                           "--kl-divergence")
    assert code == 0, err
    lines = out.splitlines()
    header = lines.index("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                         "              Δp RMS            Same top p")
    rows = lines[header + 1:header + 1 + saved.n_chunks]
    row = re.compile(r"\s+(\d+)\s+([\d.]+) ±\s+[\d.]+\s+(-?[\d.]+) ±\s+[\d.]+\s+(-?[\d.]+) ±\s+[\d.]+"
                     r"\s+[\d.]+ ±\s+[\d.]+ %\s+([\d.]+) ±\s+[\d.]+ %")
    parsed = [row.fullmatch(r).groups() for r in rows]
    assert [int(p[0]) for p in parsed] == list(range(1, saved.n_chunks + 1))
    assert float(parsed[-1][1]) == pytest.approx(ppl, abs=1e-4)  # the same model, the same numbers
    assert all(abs(float(p[3])) < 1e-4 for p in parsed)  # KL divergence: only the 16-bit rounding
    # The same top token wherever the saved row has one top. Where 16-bit rounding made several tokens
    # share the top (a near-tie), the saved run's top is the first of them, as in llama.cpp, and this
    # run's may be another: those rows, and only those, may differ (the running percentage is cumulative).
    compared = [saved.n_rows * (c + 1) for c in range(saved.n_chunks)]
    sure = [compared[c] - sum(ties[:c + 1]) for c in range(saved.n_chunks)]
    assert all(float(p[4]) >= 100.0 * s / n - 5e-4 for p, s, n in zip(parsed, sure, compared))
    assert "====== KL divergence statistics ======" in lines  # over 100 tokens compared
    same = float(re.fullmatch(r"Same top p: ([\d.]+) ± [\d.]+ %",
                              next(line for line in lines if line.startswith("Same top p:"))).group(1))
    assert same >= 100.0 * sure[-1] / compared[-1] - 5e-4
    if sum(ties) == 0:
        assert same == 100.0


def _tied_tops(rows: np.ndarray, n_vocab: int) -> int:
    """Saved rows whose largest 16-bit log-probability more than one token holds."""
    q = rows[:, 4:4 + n_vocab]
    return int(((q == q.max(axis=1, keepdims=True)).sum(axis=1) > 1).sum())


@pytest.mark.parametrize("args, fragment", [
    (["-f", "TEXT", "-c", "512"], "needs at least 1024"),
    (["-f", "TEXT", "--chunks", "0"], "--chunks 0"),
    (["-f", "TEXT", "-c", "0"], "-c 0 must be positive"),
    (["--kl-divergence"], "--kl-divergence needs --kl-divergence-base"),
    (["--kl-divergence-base", "MISSING", "--kl-divergence"], "cannot read"),
    (["--kl-divergence-base", "TEXT", "--kl-divergence"], "does not look like a file of log-probabilities"),
])
def test_bad_input_is_one_line(capsys, monkeypatch, tiny_llama_path, text_file, tmp_path, args, fragment):
    args = [str(text_file) if a == "TEXT" else str(tmp_path / "missing.kld") if a == "MISSING" else a for a in args]
    code, out, err = ggrun(capsys, monkeypatch, "perplexity", "-m", tiny_llama_path, *args)
    assert (code, out) == (2, ""), err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err


def test_kl_divergence_refuses_another_vocabulary(capsys, monkeypatch, tiny_llama_factory, bos_llama, text_file,
                                                  tmp_path):
    base = tmp_path / "base.kld"
    assert ggrun(capsys, monkeypatch, "perplexity", "-m", bos_llama, "-f", text_file, "-c", "32", "--chunks", "1",
                 "--kl-divergence-base", base)[0] == 0
    other = tiny_llama_factory(n_vocab=400)
    code, out, err = ggrun(capsys, monkeypatch, "perplexity", "-m", other, "--kl-divergence-base", base,
                           "--kl-divergence")
    assert code == 2 and "inconsistent vocabulary" in err, err
