"""The FastAPI app of `ggrun serve`: llama-server's routes over one EngineLoop.

Every route but /health, /v1/health and the chat page at / checks --api-key (a Bearer token or X-Api-Key), as
llama-server's middleware does (server-http.cpp: its public set is the health routes and the web UI's files):
the page holds no data, and its API calls carry the key the user types into it. Every failure is an
OpenAI-style error body (errors.py), never a traceback. Generation routes turn the request into an
engine_loop.Request, submit it and read its events from an asyncio queue the engine thread feeds; a
client that goes away cancels its request (its slot is free before the next step). They read and check a body
under an engine Arrival, so that an idle engine starts a burst of requests in one step rather than the first
alone while the rest are still being read.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ggrun.cli.serve import formats as f
from ggrun.cli.serve.errors import ApiError, error_body, error_response
from ggrun.cli.serve.fields import MAX_TOP_LOGPROBS, Fields, bad
from ggrun.cli.serve.metrics import prometheus_text
from ggrun.core.errors import GGRunError
from ggrun.core.llm.engine_loop import (FINISH_CANCELLED, FINISH_ERROR, Arrival, DoneEvent, EngineLoop, QueueFull,
                                        Request, TokenEvent)

CHAT_PAGE = Path(__file__).with_name("chat.html")
OPEN_ROUTES = ("/health", "/v1/health", "/")  # llama-server's public routes: health, and the page (no data)
PAGE_ROUTES = ("/",)  # the chat page: served while the model loads too, as llama-server's frontend is


@dataclass
class ServerState:
    """What the routes share: the settings, and once loaded the model's tokenizer, template and engine."""

    alias: str
    api_key: str | None = None
    metrics: bool = False
    slots: bool = True
    n_predict: int = -1  # -n: the default (and largest) number of tokens per request
    body_limit: int = 1 << 20
    model_path: str = ""
    engine: EngineLoop | None = None
    template: object | None = None  # loaders.chat.ChatTemplate, or None when the model has none
    template_source: str = ""
    grammar: object | None = None  # core.llm.grammar.GrammarCompiler, made on first use
    load_error: str = ""
    started: float = field(default_factory=time.time)

    @property
    def tok(self):
        """The model's tokenizer."""
        return self.engine.tok

    def ready(self) -> EngineLoop:
        """The engine, or 503 while the model loads (or failed to)."""
        if self.engine is None:
            raise ApiError(503, self.load_error or "Loading model")
        return self.engine


def make_app(state: ServerState) -> FastAPI:
    """The app with every route, its key check and its error handlers."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ggrun = state

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next):
        """As llama-server's pre-routing: 503 on every route but the page while the model loads (or failed to),
        then the key check on every route but OPEN_ROUTES, and the body's size before it is read."""
        if state.engine is None and request.url.path not in PAGE_ROUTES:
            return error_response(ApiError(503, state.load_error or "Loading model"))
        if state.api_key and request.url.path not in OPEN_ROUTES and not _key_ok(request, state.api_key):
            return error_response(ApiError(401, "Invalid API Key"))
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > state.body_limit:
            return error_response(ApiError(413, f"the request body is {int(size)} bytes; at most {state.body_limit}"))
        try:
            return await call_next(request)
        except ApiError as err:
            return error_response(err)

    @app.exception_handler(ApiError)
    async def api_error(_request, err: ApiError):
        """An ApiError as its error body."""
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, err: StarletteHTTPException):
        """Starlette's own errors (404, 405) as OpenAI-style bodies."""
        message = "File Not Found" if err.status_code == 404 else str(err.detail)
        return JSONResponse(error_body(err.status_code, message), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def any_error(_request, err: Exception):
        """Anything unexpected: a 500 with one line, never a traceback."""
        return JSONResponse(error_body(500, f"{type(err).__name__}: {err}"), status_code=500)

    _routes(app, state)
    return app


def _key_ok(request: HttpRequest, key: str) -> bool:
    """Whether the request carries the key: `Authorization: Bearer KEY` or `X-Api-Key: KEY`."""
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())  # in constant time


async def _body(request: HttpRequest, state: ServerState) -> Fields:
    """The request's JSON object, its size bounded (413) and its syntax checked (400)."""
    data = await request.body()
    if len(data) > state.body_limit:
        raise ApiError(413, f"the request body is {len(data)} bytes; at most {state.body_limit}")
    try:
        return Fields.of(json.loads(data or b"{}"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON") from None


def _routes(app: FastAPI, state: ServerState) -> None:
    """Register llama-server's routes on `app`."""
    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        """The chat page (cli/serve/chat.html)."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        """{"status": "ok"} once the model is loaded."""
        state.ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        """The one model, under its alias."""
        engine = state.ready()
        return {"object": "list", "data": [{"id": state.alias, "object": "model", "created": int(state.started),
                                            "owned_by": "ggrun", "meta": {"n_vocab": engine.tok.n_vocab,
                                                                          "n_ctx": engine.s.n_ctx}}]}

    @app.get("/props")
    async def props():
        """The server's settings, as llama-server's /props."""
        engine = state.ready()
        return {"default_generation_settings": {"n_ctx": engine.slot_ctx, "params": {"n_predict": state.n_predict}},
                "total_slots": len(engine.slots), "model_path": state.model_path, "model_alias": state.alias,
                "chat_template": state.template_source, "build_info": "ggrun"}

    @app.get("/slots")
    async def slots():
        """Each slot's state (501 with --no-slots)."""
        engine = state.ready()
        if not state.slots:
            raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`")
        return engine.slot_states()

    @app.get("/metrics")
    async def metrics():
        """Prometheus metrics (501 without --metrics)."""
        engine = state.ready()
        if not state.metrics:
            raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest):
        """Token ids of `content` (with_pieces: with each token's text)."""
        engine = state.ready()
        b = await _body(request, state)
        content = b.str("content", "")
        ids = engine.tok.tokenize(content, add_special=b.bool("add_special", False),
                                  parse_special=b.bool("parse_special", True))
        if b.bool("with_pieces", False):
            return {"tokens": [{"id": t, "piece": engine.tok.token_to_piece(t, True).decode("utf-8", "replace")}
                               for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
        """The text of `tokens`."""
        engine = state.ready()
        b = await _body(request, state)
        return {"content": engine.tok.detokenize(_token_list(b.raw("tokens", []), engine.tok.n_vocab, "tokens"))}

    @app.post("/apply-template")
    async def apply_template(request: HttpRequest):
        """The prompt the chat template makes of `messages`."""
        state.ready()
        b = await _body(request, state)
        return {"prompt": _render(state, b)}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: HttpRequest):
        """OpenAI chat completions over the chat template."""
        engine = state.ready()
        with engine.arrival() as arrival:
            b = await _body(request, state)
            prompt = engine.tok.tokenize(_render(state, b), add_special=True, parse_special=True)
            req = _request(state, b, prompt, openai=True)
            return await _openai(request, state, b, req, arrival, chat=True)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: HttpRequest):
        """OpenAI text completions."""
        engine = state.ready()
        with engine.arrival() as arrival:
            b = await _body(request, state)
            req = _request(state, b, _prompt_tokens(engine, b.raw("prompt")), openai=True)
            return await _openai(request, state, b, req, arrival, chat=False)

    @app.post("/completion")
    async def completion(request: HttpRequest):
        """llama-server's native completion."""
        engine = state.ready()
        with engine.arrival() as arrival:
            b = await _body(request, state)
            req = _request(state, b, _prompt_tokens(engine, b.raw("prompt")), openai=False)
            return await _native(request, state, b, req, arrival)


# ---- turning a body into an engine request ---------------------------------------------------

def _token_list(v, n_vocab: int, name: str) -> list[int]:
    """A list of token ids inside the vocabulary, else 400 naming the field."""
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad(f"'{name}' must be a list of token ids")
    if any(not 0 <= t < n_vocab for t in v):
        raise bad(f"'{name}' holds a token id outside the vocabulary (0..{n_vocab - 1})")
    return v


def _prompt_tokens(engine: EngineLoop, prompt) -> list[int]:
    """A prompt given as text (BOS added as the model wants) or as token ids; one prompt per request."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return engine.tok.tokenize(prompt, add_special=True, parse_special=True)
    if isinstance(prompt, list):
        return _token_list(prompt, engine.tok.n_vocab, "prompt")
    raise bad("'prompt' must be a string or a list of token ids")


def _render(state: ServerState, b: Fields) -> str:
    """The chat messages through the model's (or --chat-template's) template, with the generation prompt."""
    msgs = b.raw("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list")
    out = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("each message must be an object with a 'role' string")
        content = m.get("content", "")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise bad("message content parts must be {\"type\": \"text\", \"text\": ...}")
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad("a message's 'content' must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    if state.template is None:
        raise bad("the model has no chat template; give one with --chat-template")
    try:
        return state.template.render(out, add_generation_prompt=True)
    except GGRunError as err:
        raise bad(f"chat template: {err}") from None


def _request(state: ServerState, b: Fields, prompt: list[int], openai: bool) -> Request:
    """The engine request a body asks for: its prompt checked against a slot's context, then its fields."""
    engine = state.engine
    if not prompt:
        raise bad("the prompt is empty")
    if len(prompt) >= engine.slot_ctx:
        raise ApiError(400, f"the request exceeds the available context size: the prompt is {len(prompt)} tokens, "
                            f"a slot holds {engine.slot_ctx}", "exceed_context_size_error")
    b.int("n", 1, 1, 1)  # one choice per request
    n_predict = _n_predict(state, b, openai)
    n_probs, logprobs = _probs(b, openai)
    return Request(prompt, b.sampling(engine.tok.n_vocab, engine.tok.eog_ids), n_predict, b.stops(),
                   b.bool("ignore_eos", False), n_probs, logprobs, b.bool("cache_prompt", True),
                   _constraint(state, b, openai))


def _n_predict(state: ServerState, b: Fields, openai: bool) -> int:
    """Tokens to generate: max_completion_tokens / max_tokens / n_predict, capped by -n."""
    names = ("max_completion_tokens", "max_tokens", "n_predict") if openai else ("n_predict", "max_tokens")
    n = -1
    for name in names:
        if b.has(name):
            n = b.int(name, -1, -1, 1 << 30)
            break
    if state.n_predict >= 0 and (n < 0 or n > state.n_predict):
        n = state.n_predict
    return n


def _probs(b: Fields, openai: bool) -> tuple[int, bool]:
    """(top tokens to report, whether to report each token's log-prob)."""
    if not openai:
        n = b.int("n_probs", 0, 0, MAX_TOP_LOGPROBS)
        return n, n > 0
    lp = b.raw("logprobs", False)
    if isinstance(lp, bool):  # chat: logprobs true, top_logprobs n
        return b.int("top_logprobs", 0, 0, MAX_TOP_LOGPROBS), lp
    n = b.int("logprobs", 0, 0, MAX_TOP_LOGPROBS)  # legacy completions: logprobs n
    return n, True


def _constraint(state: ServerState, b: Fields, openai: bool):
    """The grammar a request asks for: response_format (json_object, json_schema), json_schema, grammar."""
    rf = b.dict("response_format")
    schema, grammar, want = None, b.str("grammar"), False
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            want, schema = True, rf.get("schema")
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad("'response_format.json_schema' must be an object")
            want, schema = True, js.get("schema", {})
        elif kind != "text":
            raise bad("'response_format.type' must be text, json_object or json_schema")
    if b.has("json_schema"):
        want, schema = True, b.dict("json_schema")
    if not want and not grammar:
        return None
    if state.grammar is None:
        try:
            from ggrun.core.llm.grammar import GrammarCompiler
        except ImportError:
            raise ApiError(501, "structured output needs llguidance (pip install 'ggrun[serve]')") from None
        state.grammar = GrammarCompiler(state.engine.tok)
    try:
        return state.grammar.json_schema(schema) if want else state.grammar.gbnf(grammar)
    except GGRunError as err:
        raise bad(str(err)) from None


# ---- running a request ------------------------------------------------------------------------

class _Events:
    """A request's events, carried from the engine thread to the request's task."""

    def __init__(self) -> None:
        """Events go to a queue of the running event loop."""
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, ev) -> None:
        """Called on the engine thread: hand the event to the request's loop."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)


def _submit(engine: EngineLoop, req: Request, arrival: Arrival):
    """Submit to the engine with an event queue, closing the request's arrival; 503 when the wait queue is full."""
    events = _Events()
    try:
        handle = engine.submit(req, events, arrival)
    except QueueFull as err:
        raise ApiError(503, f"the server is busy: {err}; try again later") from None
    return handle, events


async def _events(engine: EngineLoop, handle, events: _Events, request: HttpRequest) -> AsyncIterator:
    """The request's events as they come; a client that disconnects (checked every 0.1 s, or the stream's task
    cancelled) cancels it."""
    done = False
    try:
        while True:
            try:
                ev = await asyncio.wait_for(events.queue.get(), 0.1)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            done = isinstance(ev, DoneEvent)
            yield ev
            if done:
                return
    finally:
        if not done:
            engine.cancel(handle)


def _check_done(done: DoneEvent) -> None:
    """A request the engine ended with an error is a 500 with its one line."""
    if done.finish_reason == FINISH_ERROR:
        raise ApiError(500, f"generation failed: {done.error}", "server_error")


async def _openai(request: HttpRequest, state: ServerState, b: Fields, req: Request, arrival: Arrival, chat: bool):
    """Serve an OpenAI chat or text completion, whole or as server-sent events ending in [DONE]."""
    engine = state.engine
    stream = b.bool("stream", False)
    so = b.dict("stream_options") or {}
    include_usage = bool(so.get("include_usage", False))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    handle, events = _submit(engine, req, arrival)
    tok = engine.tok
    if not stream:
        toks, done = await _collect(engine, handle, events, request)
        if done is None:
            return Response(status_code=499)
        _check_done(done)
        if chat:
            lp = f.chat_logprobs(tok, toks) if req.logprobs else None
            return f.chat_body(rid, state.alias, done.text, done, lp)
        lp = f.text_logprobs(tok, toks) if req.logprobs else None
        return f.text_body(rid, state.alias, done.text, done, lp)

    async def gen():
        """The response's server-sent events."""
        if chat:
            yield f.sse(f.chat_chunk(rid, state.alias, {"role": "assistant", "content": None}))
        async for ev in _events(engine, handle, events, request):
            if isinstance(ev, TokenEvent):
                if not ev.text and ev.logprob is None:
                    continue
                if chat:
                    lp = f.chat_logprobs(tok, [ev]) if req.logprobs else None
                    yield f.sse(f.chat_chunk(rid, state.alias, {"content": ev.text}, None, lp))
                else:
                    lp = f.text_logprobs(tok, [ev]) if req.logprobs else None
                    yield f.sse(f.text_chunk(rid, state.alias, ev.text, None, lp))
                continue
            if ev.finish_reason == FINISH_ERROR:
                yield f.sse(error_body(500, f"generation failed: {ev.error}"))
                return
            if ev.finish_reason == FINISH_CANCELLED:
                return
            if chat:
                yield f.sse(f.chat_chunk(rid, state.alias, {}, f.finish_reason(ev)) | {"timings": f.timings(ev)})
            else:
                yield f.sse(f.text_chunk(rid, state.alias, "", f.finish_reason(ev)) | {"timings": f.timings(ev)})
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield f.sse(f.usage_chunk(rid, state.alias, obj, ev))
            yield f.DONE_LINE

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _collect(engine: EngineLoop, handle, events: _Events, request: HttpRequest):
    """Every token event and the DoneEvent of a request (None when the client went away first)."""
    toks: list[TokenEvent] = []
    async for ev in _events(engine, handle, events, request):
        if isinstance(ev, DoneEvent):
            return toks, ev
        toks.append(ev)
    return toks, None


async def _native(request: HttpRequest, state: ServerState, b: Fields, req: Request, arrival: Arrival):
    """Serve llama-server's native /completion, whole or streamed."""
    engine = state.engine
    handle, events = _submit(engine, req, arrival)
    tok = engine.tok
    settings = {"n_predict": req.n_predict, "temperature": req.sampling.temp, "top_k": req.sampling.top_k,
                "top_p": req.sampling.top_p, "min_p": req.sampling.min_p, "seed": req.sampling.seed,
                "stop": list(req.stops), "n_probs": req.n_probs, "cache_prompt": req.cache_prompt}
    if not b.bool("stream", False):
        toks, done = await _collect(engine, handle, events, request)
        if done is None:
            return Response(status_code=499)
        _check_done(done)
        probs = f.native_probs(tok, toks) if req.n_probs else None
        return f.native_body(state.alias, done.text, done, [t.token for t in toks], probs, settings)

    async def gen():
        """The response's server-sent events."""
        async for ev in _events(engine, handle, events, request):
            if isinstance(ev, TokenEvent):
                chunk = {"content": ev.text, "tokens": [ev.token], "stop": False, "id_slot": -1}
                if req.n_probs:
                    chunk["completion_probabilities"] = f.native_probs(tok, [ev])
                yield f.sse(chunk)
            elif ev.finish_reason == FINISH_ERROR:
                yield f.sse(error_body(500, f"generation failed: {ev.error}"))
            elif ev.finish_reason != FINISH_CANCELLED:
                yield f.sse(f.native_body(state.alias, "", ev, [], None, settings))

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
