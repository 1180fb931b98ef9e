"""Render a model's Jinja chat template (tokenizer.chat_template) the way Hugging Face transformers does.

Templates run in an immutable sandbox; a template error becomes one BadInput line, never a traceback.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ggrun.core.errors import BadInput


class _TemplateRaised(Exception):
    """The template called raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: unlike Jinja's built-in it does not HTML-escape
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """The prompt text for messages ([{"role": ..., "content": ...}, ...]); extra goes to the template as is."""
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra)
    except _TemplateRaised as e:
        raise BadInput(f"chat template refused the messages: {e}") from None
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if isinstance(e, jinja2.TemplateSyntaxError) else ""
        raise BadInput(f"chat template error{where}: {_one_line(str(e))}") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())
