"""One HTTP request run through an ASGI app in this process, its response handed on as the app sends it.

This is how a Ray Serve replica (cli/serve/cluster.py) serves `ggrun serve`'s own FastAPI app: the ingress
forwards the request's method, path, headers and body (an HttpCall, which pickles), the replica runs them
through the app and streams back the response's start and its body chunks. httpx's ASGI transport would do
the call too, but it holds the whole body until the app ends, which would turn every stream into one reply.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

Asgi = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True)
class HttpCall:
    """A request as the app sees it: method, path, query string, headers (lower-case names) and body."""

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""


@dataclass(frozen=True)
class ResponseStart:
    """A response's status and headers, the first thing `call_app` yields."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...] = ()


def _scope(call: HttpCall) -> dict:
    """The ASGI scope of `call`, as a server on loopback would make it."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method,
            "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "query_string": call.query,
            "root_path": "", "headers": [tuple(h) for h in call.headers], "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 80)}


async def call_app(app: Asgi, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
    """Run `call` through `app`: yield its ResponseStart, then each body chunk as the app sends it. Closing
    the iterator early (the caller went away) tells the app its client disconnected, as a server would."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        """The body once, then (when the caller has gone) a disconnect."""
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        """The app's response messages, in order."""
        await out.put(message)

    task = asyncio.create_task(app(_scope(call), receive, send))
    task.add_done_callback(lambda t: out.put_nowait(None))
    try:
        while (message := await out.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple(tuple(h) for h in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    finally:
        gone.set()
