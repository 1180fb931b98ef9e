"""Acceptance of the perplexity method on the real models against llama-perplexity's own figures on the
same text (tests/data/ppl_prose_llama.json, made on tests/data/ppl_prose.txt): the running estimate
after four chunks of 256 tokens within 1% (measured 0.01% on SmolLM2, 0.35% on gemma-3-270m; all
chunks and -c 512 are what scripts/bench/ppl_vs_llama.py compares). Skipped unless a model is cached."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ggrun.core.llm.perplexity import Estimate, evaluate_chunks, plan_chunks, token_nll
from ggrun.core.llm.session import Session, SessionParams

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1] / "data"
CHUNKS = 4


def running_estimates(model, n_ctx: int, n_chunks: int) -> list[float]:
    text = (DATA / "ppl_prose.txt").read_text(encoding="utf-8").removesuffix("\n")  # as llama.cpp's -f reads it
    tokens = model.tokenizer.tokenize(text, add_special=True, parse_special=False)
    plan = plan_chunks(len(tokens), n_ctx, n_chunks)
    session = Session(model, SessionParams(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(512, n_ctx)))
    est = Estimate()
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    for chunk in evaluate_chunks(session, tokens, plan, n_ctx, bos):
        est.add(token_nll(chunk.logits, chunk.targets))
    return est.running


@pytest.fixture(scope="module")
def llama_figures() -> dict:
    return json.loads((DATA / "ppl_prose_llama.json").read_text(encoding="utf-8"))


def test_smollm2_within_one_percent_of_llama_perplexity(smollm2, llama_figures):
    want = llama_figures["SmolLM2-135M-Instruct.Q4_1.gguf"]["256"]["running"][:CHUNKS]
    got = running_estimates(smollm2, 256, CHUNKS)
    print(f"\nSmolLM2 -c 256, {CHUNKS} chunks: ggrun {got}, llama-perplexity {want}")
    assert got[-1] == pytest.approx(want[-1], rel=0.01)


def test_gemma3_within_one_percent_of_llama_perplexity(llama_figures):
    from ggrun.core.backends.cpu import CPUBackend
    from ggrun.core.llm.model import Model
    from ggrun.loaders.download import KNOWN_MODELS, is_cached, model_path

    known = KNOWN_MODELS["gemma3-270m"]
    if not is_cached(known):
        pytest.skip(f"{known.file} is not in the ggrun cache; run `ggrun models pull gemma3-270m`")
    want = llama_figures["gemma-3-270m-q4_k_m.gguf"]["256"]["running"][:CHUNKS]
    got = running_estimates(Model.load(model_path(known), [CPUBackend()]), 256, CHUNKS)
    print(f"\ngemma-3-270m -c 256, {CHUNKS} chunks: ggrun {got}, llama-perplexity {want}")
    assert got[-1] == pytest.approx(want[-1], rel=0.01)
