"""Structured output through llguidance (core/llm/grammar.py) on the tiny llama's byte vocabulary: whatever
the random model prefers, every sampled reply under a JSON schema parses and validates, and one under a GBNF
grammar is one of the strings it derives; a bad schema or grammar is BadInput."""
from __future__ import annotations

import json

import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.errors import BadInput
from ggrun.core.llm.engine_loop import FINISH_STOP, Request
from ggrun.core.llm.model import Model
from ggrun.core.llm.sampling import SamplingParams
from tests.llm.test_engine_loop import Collector, engine

pytest.importorskip("llguidance")
from ggrun.core.llm.grammar import GrammarCompiler  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tiny_llama_path) -> Model:
    return Model.load(tiny_llama_path, [CPUBackend()])


def test_schema_and_grammar_hold_for_every_seed(tiny):
    g = GrammarCompiler(tiny.tokenizer)
    e = engine(tiny, n_slots=4)
    reqs = [Request([1, 2, 3], SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s), 200,
                    constraint=g.json_schema(SCHEMA)) for s in range(3)]
    reqs.append(Request([4, 5], SamplingParams(temp=1.0, seed=9), 50, constraint=g.gbnf('root ::= "yes" | "no"')))
    cols = [Collector() for _ in reqs]
    for r, c in zip(reqs, cols):
        e.submit(r, c)
    e.start()
    try:
        done = [c.wait() for c in cols]
    finally:
        e.stop()
    for d in done[:3]:
        assert d.finish_reason == FINISH_STOP, d
        obj = json.loads(d.text)
        assert set(obj) == {"n", "ok"} and isinstance(obj["ok"], bool)
        assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 99
    assert done[3].text in ("yes", "no")


def test_bad_schema_or_grammar_is_bad_input(tiny):
    g = GrammarCompiler(tiny.tokenizer)
    with pytest.raises(BadInput):
        g.gbnf("root ::= (")
    with pytest.raises(BadInput):
        g.json_schema({"type": "no-such-type"})
