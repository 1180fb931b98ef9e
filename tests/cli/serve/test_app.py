"""The app's routes without a model (FastAPI's test client, in-process): every route but /health, /v1/health and
the chat page wants the key (llama-server's public set); while the model loads every route but the page says 503,
before the key is checked (llama-server's order); unknown routes 404; bodies are
OpenAI-style errors. The served routes with a model are tested on a real server (test_serve.py)."""
from __future__ import annotations

from contextlib import contextmanager

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


ROUTES = (("get", "/v1/models"), ("get", "/models"), ("get", "/props"), ("get", "/slots"),
          ("get", "/metrics"), ("post", "/v1/chat/completions"), ("post", "/v1/completions"),
          ("post", "/completion"), ("post", "/tokenize"), ("post", "/detokenize"), ("post", "/apply-template"))


def test_while_loading_every_route_but_the_page_says_503_before_the_key(client):
    """llama-server's order: the server's state first (503 "Loading model"), then the key."""
    for method, path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer k"}, {"Authorization": "Bearer wrong"}):
            r = getattr(client, method)(path, headers=headers)
            assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model", (path, headers)


def test_once_loaded_every_other_route_wants_the_key(client):
    """Past loading, a route answers 401 without the key (a stand-in engine: the key check comes first)."""
    client.app.state.ggrun.engine = object()
    for method, path in ROUTES:
        r = getattr(client, method)(path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        r = getattr(client, method)(path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, path


def test_the_chat_page_and_unknown_routes(client):
    page = client.get("/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text
    assert "://" not in page.text  # self-contained: nothing is fetched from another host
    client.app.state.ggrun.engine = object()  # loaded: an unknown route is a 404 past the key
    r = client.get("/v2/nothing", headers={"Authorization": "Bearer k"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


class ArrivalCounter:
    """A stand-in engine that only counts the Arrivals the generation routes open and close."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0

    @contextmanager
    def arrival(self):
        """A context whose exit counts the arrival closed."""
        self.opened += 1
        try:
            yield None
        finally:
            self.closed += 1


def test_generation_routes_close_the_arrival_of_a_refused_body(client):
    """Each generation route reads its body under an engine Arrival (an idle engine holds its first step for
    it), and one refused before its submit (bad JSON) leaves none open behind it."""
    counter = ArrivalCounter()
    client.app.state.ggrun.engine = counter
    for path in ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion"):
        r = client.post(path, content=b"{not json", headers={"Authorization": "Bearer k"})
        assert r.status_code == 400, path
    assert counter.opened == counter.closed == 5
