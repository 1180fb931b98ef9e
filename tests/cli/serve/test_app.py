"""The app's routes without a model (FastAPI's test client, in-process): every route but /health, /v1/health and
the chat page wants the key (llama-server's public set); while the model loads /health and the model routes say 503; unknown routes 404; bodies are
OpenAI-style errors. The served routes with a model are tested on a real server (test_serve.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from ggrun.cli.serve.app import ServerState, make_app  # noqa: E402


@pytest.fixture
def client():
    return TestClient(make_app(ServerState(alias="m", api_key="k")))


def test_health_says_503_while_loading_without_a_key(client):
    for path in ("/health", "/v1/health"):
        r = client.get(path)
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def test_every_other_route_wants_the_key(client):
    for method, path in (("get", "/v1/models"), ("get", "/models"), ("get", "/props"), ("get", "/slots"),
                         ("get", "/metrics"), ("post", "/v1/chat/completions"), ("post", "/v1/completions"),
                         ("post", "/completion"), ("post", "/tokenize"), ("post", "/detokenize"),
                         ("post", "/apply-template")):
        r = getattr(client, method)(path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        r = getattr(client, method)(path, headers={"Authorization": "Bearer k"})
        assert r.status_code == 503, path  # past the key: the model is still loading
    assert client.get("/v1/models", headers={"X-Api-Key": "k"}).status_code == 503


def test_the_chat_page_and_unknown_routes(client):
    page = client.get("/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text
    assert "://" not in page.text  # self-contained: nothing is fetched from another host
    r = client.get("/v2/nothing", headers={"Authorization": "Bearer k"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
