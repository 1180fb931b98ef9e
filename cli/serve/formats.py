"""Response bodies as llama-server writes them: OpenAI's chat.completion(.chunk) and text_completion, and
the native /completion's content, timings and completion_probabilities."""
from __future__ import annotations

import json
import time

from ggrun.core.llm.engine_loop import FINISH_LENGTH, DoneEvent, TokenEvent

DONE_LINE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def finish_reason(done: DoneEvent) -> str:
    """OpenAI's finish_reason: 'length' at the token limit, else 'stop'."""
    return "length" if done.finish_reason == FINISH_LENGTH else "stop"


def timings(done: DoneEvent) -> dict:
    """llama-server's timings object of a finished request."""
    n_eval = done.n_prompt - done.n_cached
    pn, gn = max(n_eval, 0), done.n_predicted
    return {"cache_n": done.n_cached, "prompt_n": pn, "prompt_ms": done.prompt_ms,
            "prompt_per_token_ms": done.prompt_ms / pn if pn else 0.0,
            "prompt_per_second": 1e3 * pn / done.prompt_ms if done.prompt_ms else 0.0,
            "predicted_n": gn, "predicted_ms": done.predicted_ms,
            "predicted_per_token_ms": done.predicted_ms / gn if gn else 0.0,
            "predicted_per_second": 1e3 * gn / done.predicted_ms if done.predicted_ms else 0.0}


def usage(done: DoneEvent) -> dict:
    """OpenAI's usage object (cached prompt tokens among the details)."""
    return {"prompt_tokens": done.n_prompt, "completion_tokens": done.n_predicted,
            "total_tokens": done.n_prompt + done.n_predicted,
            "prompt_tokens_details": {"cached_tokens": done.n_cached}}


def _piece(tok, tid: int) -> tuple[str, list[int]]:
    """A token's text and bytes as the logprobs objects give them."""
    data = tok.token_to_piece(tid, False)
    return data.decode("utf-8", "replace"), list(data)


def chat_logprobs(tok, events: list[TokenEvent]) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for ev in events:
        if ev.logprob is None:
            continue
        text, data = _piece(tok, ev.token)
        top = []
        for tid, lp in ev.logprob.top:
            t, b = _piece(tok, tid)
            top.append({"id": tid, "token": t, "logprob": lp, "bytes": b})
        content.append({"id": ev.token, "token": text, "logprob": ev.logprob.logprob, "bytes": data,
                        "top_logprobs": top})
    return {"content": content}


def text_logprobs(tok, events: list[TokenEvent], offset: int = 0) -> dict:
    """The legacy completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events:
        if ev.logprob is None:
            continue
        text, _ = _piece(tok, ev.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(ev.logprob.logprob)
        out["top_logprobs"].append({_piece(tok, t)[0]: lp for t, lp in ev.logprob.top})
        out["text_offset"].append(offset)
        offset += len(ev.text)
    return out


def native_probs(tok, events: list[TokenEvent]) -> list[dict]:
    """/completion's completion_probabilities (llama-server's newer form, log-probabilities)."""
    out = []
    for ev in events:
        if ev.logprob is None:
            continue
        text, data = _piece(tok, ev.token)
        out.append({"id": ev.token, "token": text, "logprob": ev.logprob.logprob, "bytes": data,
                    "top_logprobs": [{"id": t, "token": _piece(tok, t)[0], "logprob": lp, "bytes": _piece(tok, t)[1]}
                                     for t, lp in ev.logprob.top]})
    return out


def chat_body(rid: str, model: str, text: str, done: DoneEvent, logprobs: dict | None) -> dict:
    """A whole chat.completion."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(done),
              "logprobs": logprobs}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(done), "timings": timings(done)}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
    """One chat.completion.chunk of a stream."""
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


def text_body(rid: str, model: str, text: str, done: DoneEvent, logprobs: dict | None) -> dict:
    """A whole text_completion."""
    choice = {"index": 0, "text": text, "finish_reason": finish_reason(done), "logprobs": logprobs}
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(done), "timings": timings(done)}


def text_chunk(rid: str, model: str, text: str, finish: str | None = None, logprobs: dict | None = None) -> dict:
    """One text_completion chunk of a stream."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}


def usage_chunk(rid: str, model: str, obj: str, done: DoneEvent) -> dict:
    """stream_options.include_usage: a last chunk with no choices and the usage."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(done), "timings": timings(done)}


def native_body(model: str, text: str, done: DoneEvent, tokens: list[int], probs: list[dict] | None,
                settings: dict) -> dict:
    """/completion's whole answer, or its last streamed event."""
    stop_type = {"stop": "word" if done.stop_word else "eos", "length": "limit"}.get(done.finish_reason, "none")
    body = {"content": text, "tokens": tokens, "id_slot": done.slot, "stop": True, "model": model,
            "tokens_predicted": done.n_predicted, "tokens_evaluated": done.n_prompt, "generation_settings": settings,
            "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type, "stopping_word": done.stop_word,
            "tokens_cached": done.n_prompt + done.n_predicted, "timings": timings(done)}
    if probs is not None:
        body["completion_probabilities"] = probs
    return body
