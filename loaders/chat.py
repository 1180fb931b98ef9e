"""Render a model's Jinja chat template (tokenizer.chat_template) the way Hugging Face transformers does;
llama.cpp's built-in templates by name, and its handling of the BOS and EOS texts a template writes.

Templates run in an immutable sandbox; a template error becomes one BadInput line, never a traceback.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

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
def _compile(template: str):
    """The compiled jinja2.Template (jinja2 is imported here, on first use: a run that renders no chat
    does not pay for it)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """The prompt text for messages ([{"role": ..., "content": ...}, ...]); extra goes to the template as is."""
    import jinja2

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


# llama.cpp's built-in templates that --chat-template accepts by name (src/llama-chat.cpp), as Jinja
BUILTIN_TEMPLATES = {
    "chatml": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "gemma": "{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
             "{% set ns.system = ns.system + m['content'] | trim %}{% else %}"
             "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}{{ '<start_of_turn>' + role + '\\n' }}"
             "{% if ns.system and role != 'model' %}{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}"
             "{{ m['content'] | trim + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
    "llama3": "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
              " + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    "phi3": "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    "zephyr": "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|endoftext|>\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
}


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the tokenizer's BOS and EOS texts. When the tokenizer adds BOS (or EOS) to
    the prompt itself, a rendered text that starts with it (ends with it) loses it, as in llama.cpp,
    so that a prompt never holds two."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    strip_bos: bool = False
    strip_eos: bool = False

    @staticmethod
    def named(name_or_source: str, **tokens: Any) -> "ChatTemplate":
        """A built-in template by llama.cpp's name (BUILTIN_TEMPLATES), or the Jinja source given."""
        return ChatTemplate(BUILTIN_TEMPLATES.get(name_or_source, name_or_source), **tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = render_chat(self.source, messages, add_generation_prompt, self.bos_token, self.eos_token)
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.strip_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        return text
