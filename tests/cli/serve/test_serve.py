"""`ggrun serve` end to end: a real server subprocess on SmolLM2 (conftest.py), spoken to with the official
`openai` client and with plain HTTP. Chat and completion, whole and streamed, stop strings, seeds, logprobs,
JSON schemas, tokenize round trips, metrics, the API key, bad fields, a disconnect that frees its slot,
and 32 concurrent streaming clients each getting the text it gets alone (--numerics f32, the tiny llama).
Two replies compared are made alike (cache_prompt off: each prompt evaluated whole, in one batch)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.cli.serve.conftest import KEY

openai = pytest.importorskip("openai")
import httpx  # noqa: E402 - after the skip: conftest skips without it

pytestmark = pytest.mark.slow
MSG = [{"role": "user", "content": "What is the capital of France?"}]
FRESH = {"cache_prompt": False}


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, http_client=httpx.Client(trust_env=False),
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def sse_events(response) -> list:
    """The data of each server-sent event of a streamed response; '[DONE]' as a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_whole_and_streamed_agree(oa):
    whole = oa.chat.completions.create(model="smol", messages=MSG, max_tokens=16, temperature=0, extra_body=FRESH)
    text = whole.choices[0].message.content
    assert "Paris" in text or text  # SmolLM2's greedy answer; the check that matters is the agreement below
    assert whole.usage.completion_tokens <= 16 and whole.usage.prompt_tokens > 5
    assert whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(oa.chat.completions.create(model="smol", messages=MSG, max_tokens=16, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body=FRESH))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completion_streams_sse_ending_in_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6,
                                                      "temperature": 0, "stream": True, **FRESH}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    whole = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6,
                                               "temperature": 0, **FRESH}).json()
    assert whole["choices"][0]["text"] == text and whole["object"] == "text_completion"


def test_native_completion_fields(http):
    r = http.post("/completion", json={"prompt": "The capital of France is", "n_predict": 4, "temperature": 0,
                                       "n_probs": 2, **FRESH}).json()
    assert r["tokens_predicted"] == 4 and r["stop"] is True and r["stop_type"] == "limit"
    assert len(r["completion_probabilities"]) == 4
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"} <= set(r["timings"])
    again = http.post("/completion", json={"prompt": "The capital of France is", "n_predict": 4,
                                           "temperature": 0}).json()
    assert again["content"] == r["content"] and again["timings"]["cache_n"] > 0


def test_stop_strings_cut_the_text(oa):
    base = oa.completions.create(model="smol", prompt="Count: one, two, three,", max_tokens=24, temperature=0,
                                 extra_body=FRESH)
    text = base.choices[0].text
    stop = text.strip()[3:6]
    cut = oa.completions.create(model="smol", prompt="Count: one, two, three,", max_tokens=24, temperature=0,
                                stop=[stop], extra_body=FRESH)
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_a_seed_repeats_a_sampled_reply(oa):
    kw = dict(model="smol", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20,
              temperature=1.0, seed=42, extra_body=FRESH)
    a = oa.chat.completions.create(**kw).choices[0].message.content
    b = oa.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_logprobs_of_a_greedy_reply(oa):
    r = oa.chat.completions.create(model="smol", messages=MSG, max_tokens=5, temperature=0, logprobs=True,
                                   top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and len(content) <= 5
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.top_logprobs[0].token == tok.token and tok.top_logprobs[0].logprob == pytest.approx(tok.logprob)


def test_json_schema_output_validates(oa, http):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = oa.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=80,
        temperature=0.7, seed=5, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
    assert 0 <= obj["age"] <= 150 and len(obj["name"]) <= 20
    native = http.post("/completion", json={"prompt": "Answer yes or no:", "n_predict": 10,
                                            "grammar": 'root ::= "yes" | "no"'}).json()
    assert native["content"] in ("yes", "no")


def test_tokenize_detokenize_round_trip(http):
    text = "Hello, wörld! 你好 🙂"
    toks = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    assert http.post("/detokenize", json={"tokens": toks}).json()["content"] == text
    pieces = http.post("/tokenize", json={"content": "Hi", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hi"
    prompt = http.post("/apply-template", json={"messages": MSG}).json()["prompt"]
    assert "What is the capital of France?" in prompt


def test_info_routes(http):
    assert http.get("/v1/models").json()["data"][0]["id"]
    props = http.get("/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 1024
    assert len(http.get("/slots").json()) == 4


def metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_metrics_move(http):
    before = metric(http, "tokens_predicted_total"), metric(http, "n_decode_total")
    http.post("/completion", json={"prompt": "Once upon a time", "n_predict": 3, "temperature": 0})
    after = metric(http, "tokens_predicted_total"), metric(http, "n_decode_total")
    assert after[0] == before[0] + 3 and after[1] >= before[1] + 3
    assert "# TYPE llamacpp:prompt_tokens_total counter" in http.get("/metrics").text


def test_the_api_key_is_required_but_for_health(server):
    with server.client(key=None) as c:
        r = c.post("/v1/chat/completions", json={"messages": MSG})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/metrics").status_code == 401
        assert c.get("/health").status_code == 200
    with server.client(key="wrong") as c:
        assert c.get("/v1/models").status_code == 401


@pytest.mark.parametrize("path,body,status", [
    ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": -5}, 400),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400),
    ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"99999999": 1}}, 400),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "yaml"}}, 400),
    ("/v1/completions", {"prompt": 12}, 400),
    ("/v1/completions", {"prompt": "hi " * 3000}, 400),
    ("/completion", {"prompt": "x", "grammar": "root ::= ("}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/no/such/route", {}, 404),
])
def test_bad_requests_get_an_error_body(http, path, body, status):
    r = http.post(path, json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and "Traceback" not in r.text


def test_bad_json_and_a_body_too_large(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/completions", content=b" " * (2 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert http.post("/completion", json={"prompt": "ok", "n_predict": 1}).status_code == 200  # still serving


def busy_slots(http) -> int:
    return sum(s["is_processing"] for s in http.get("/slots").json())


def test_a_disconnect_mid_stream_frees_the_slot(server, http):
    with server.client() as c:
        with c.stream("POST", "/completion", json={"prompt": "Write a long essay.", "n_predict": 900,
                                                   "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 6:
                    break
            assert busy_slots(http) == 1
    deadline = time.monotonic() + 5
    while busy_slots(http) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy_slots(http) == 0


def test_32_concurrent_streaming_clients_each_get_their_text_alone(tiny_server):
    prompts = [f"Client {i} says: " + "abcdefgh"[i % 8] * (1 + i % 5) for i in range(32)]
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with tiny_server.client() as c:
        alone = [c.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"] for p in prompts]
    got: list[str | None] = [None] * 32

    def client(i: int) -> None:
        with tiny_server.client() as c:
            with c.stream("POST", "/v1/completions", json={**body, "prompt": prompts[i], "stream": True}) as r:
                events = sse_events(r)
        assert events[-1] == "[DONE]"
        got[i] = "".join(e["choices"][0]["text"] for e in events[:-1])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone
    assert len(set(alone)) > 8  # the prompts lead to different texts
