"""call_app (how a Ray Serve replica runs `ggrun serve`'s app in-process): a response's start, then its body
chunks as the app sends them (not held to the end); the request's method, path, query, headers and body reach
the app; closing the iterator early tells the app its client went away."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402

from ggrun.cli.serve.asgi_call import HttpCall, ResponseStart, call_app  # noqa: E402


def app_with(events: list[str], release: asyncio.Event) -> FastAPI:
    """/echo answers what reached it; /stream sends one chunk, a second once `release` is set, then waits for
    its client to go away, noting each in `events`."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"q": request.url.query, "k": request.headers.get("x-k"), "body": (await request.body()).decode()}

    @app.get("/stream")
    async def stream(request: Request):
        async def gen():
            yield b"first"
            events.append("first sent")
            await release.wait()
            yield b"second"
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            events.append("disconnected")
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def test_a_whole_reply_and_what_reaches_the_app():
    async def go():
        app = app_with([], asyncio.Event())
        return [p async for p in call_app(app, HttpCall("POST", "/echo", b"a=1", ((b"x-k", b"v"),), b"hello"))]

    start, body = asyncio.run(go())
    assert isinstance(start, ResponseStart) and start.status == 200
    assert body == b'{"q":"a=1","k":"v","body":"hello"}'


def test_chunks_come_as_sent_and_closing_early_disconnects():
    async def go():
        events: list[str] = []
        release = asyncio.Event()
        parts = call_app(app_with(events, release), HttpCall("GET", "/stream"))
        start = await parts.__anext__()
        first = await parts.__anext__()  # before the app may send its second chunk
        release.set()
        second = await parts.__anext__()
        await parts.aclose()
        for _ in range(200):
            if "disconnected" in events:
                break
            await asyncio.sleep(0.01)
        return start, first, second, events

    start, first, second, events = asyncio.run(go())
    assert start.status == 200 and (first, second) == (b"first", b"second")
    assert events == ["first sent", "disconnected"]
