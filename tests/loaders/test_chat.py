"""llama.cpp's built-in chat templates by name (`--chat-template gemma`) render as llama.cpp renders them:
the goldens are what llama-completion printed as its "chat template example" for each name. A template
that writes the BOS (EOS) text loses it when the tokenizer adds the token itself, as in llama.cpp."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from ggrun.loaders.chat import BUILTIN_TEMPLATES, ChatTemplate

EXAMPLE = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"},
           {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "How are you?"}]

GOLDEN = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
              "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
              "<|im_start|>assistant\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\n"
             "Hi there<end_of_turn>\n<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
            "<|user|>\nHow are you?<|end|>\n<|assistant|>\n",
    "zephyr": "<|system|>\nYou are a helpful assistant<|endoftext|>\n<|user|>\nHello<|endoftext|>\n<|assistant|>\n"
              "Hi there<|endoftext|>\n<|user|>\nHow are you?<|endoftext|>\n<|assistant|>\n",
}


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_template_renders_as_llama_cpp(name):
    assert ChatTemplate.named(name).render(EXAMPLE, add_generation_prompt=True) == GOLDEN[name]


def test_gemma_trims_contents_and_keeps_a_system_prompt_for_the_first_user_turn():
    messages = [{"role": "system", "content": "  terse  "}, {"role": "assistant", "content": " hi "},
                {"role": "user", "content": " q "}]
    assert ChatTemplate.named("gemma").render(messages, add_generation_prompt=False) == \
        "<start_of_turn>model\nhi<end_of_turn>\n<start_of_turn>user\nterse\n\nq<end_of_turn>\n"


def test_a_name_it_does_not_know_is_jinja_source():
    assert ChatTemplate.named("{{ messages[0]['content'] }}!").render(EXAMPLE[1:2]) == "Hello!"


def test_bos_and_eos_texts_are_dropped_when_the_tokenizer_adds_them():
    source = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}"
    messages = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(source, "<s>", "</s>").render(messages) == "<s>hi</s>"
    assert ChatTemplate(source, "<s>", "</s>", strip_bos=True, strip_eos=True).render(messages) == "hi"


# gpt-oss's harmony template (llama.cpp's models/templates/openai-gpt-oss-120b.jinja, what its GGUFs carry), and
# what llama-completion --jinja printed as its chat template example on a tiny gpt-oss file carrying it (the
# date line is the day's: strftime_now).
GPT_OSS_TEMPLATE = (Path(__file__).parents[1] / "data" / "chat_template_gpt_oss.jinja").read_text(encoding="utf-8")
GPT_OSS_GOLDEN = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
    "Current date: {date}\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be "
    "included for every message.<|end|><|start|>developer<|message|># Instructions\n\nYou are a helpful assistant\n\n"
    "<|end|><|start|>user<|message|>Hello<|end|><|start|>assistant<|channel|>final<|message|>Hi there<|end|>"
    "<|start|>user<|message|>How are you?<|end|><|start|>assistant")


def test_gpt_oss_template_renders_as_llama_cpp():
    text = ChatTemplate(GPT_OSS_TEMPLATE).render(EXAMPLE, add_generation_prompt=True)
    assert text == GPT_OSS_GOLDEN.format(date=datetime.now().strftime("%Y-%m-%d"))
