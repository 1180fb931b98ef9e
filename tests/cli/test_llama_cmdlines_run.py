"""Command lines from llama.cpp's own documentation for llama-cli and llama-completion, each parsed by
`ggrun run`'s option declarations into the settings record (cli.run_settings) and checked for the
meaning llama.cpp gives them. Nothing runs a model here: `parse_settings` stops at the record.

Sources (llama.cpp tree): tools/completion/README.md (quick start, options table, examples),
tools/completion/completion.cpp (print_usage), tools/cli/README.md (options table), docs/build.md,
docs/docker.md, docs/android.md, docs/multi-gpu.md, docs/backend/snapdragon/*.md,
docs/development/token_generation_performance_tips.md, examples/convert-llama2c-to-ggml/README.md,
tools/cvector-generator/README.md. Options ggrun has no use for (--control-vector-*) and the split mode it
lacks (-sm tensor) are left out of the copied lines; everything else is as printed there.
"""
from __future__ import annotations

import math
import shlex

import pytest

from ggrun.cli import options as o
from ggrun.cli.cmdline import parse_settings
from ggrun.cli.run_settings import RunSettings, process_escapes, run_settings
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.llm.placement import DeviceSplit
from tests.cli.runner import ggrun

M = "-m models/gemma-1.1-7b-it.Q4_K_M.gguf"

CASES = [
    # tools/completion/README.md, quick start
    (f"llama-completion {M} -no-cnv --prompt 'Once upon a time'",
     {"conversation": False, "prompt": "Once upon a time", "model": "models/gemma-1.1-7b-it.Q4_K_M.gguf"}),
    (f"llama-completion {M} --chat-template gemma", {"conversation": None, "chat_template": "gemma", "prompt": None}),
    (f"llama-completion {M} --jinja", {"conversation": None, "chat_template": None}),
    (f"llama-completion {M} --jinja --single-turn -sys 'You are a helpful assistant' -p 'Hello'",
     {"single_turn": True, "system_prompt": "You are a helpful assistant", "prompt": "Hello"}),
    (f"llama-completion {M} --ignore-eos -n -1", {"ignore_eos": True, "n_predict": -1}),
    # tools/completion/README.md, interaction and generation flags
    ("llama-completion -r 'User:' --in-prefix ' '",
     {"reverse_prompts": ("User:",), "in_prefix": " ", "use_chat_template": False}),
    ("llama-completion -r 'User:' --in-prefix ' ' --in-suffix 'Assistant:'",
     {"reverse_prompts": ("User:",), "in_prefix": " ", "in_suffix": "Assistant:", "use_chat_template": False}),
    ("llama-completion -i -r 'User:' -r 'Bob:'", {"interactive": True, "reverse_prompts": ("User:", "Bob:")}),
    ("llama-completion --interactive-first", {"interactive_first": True}),
    ("llama-completion -cnv", {"conversation": True}),
    ("llama-completion --temp 0", {"sampling.temp": 0.0}),
    ("llama-completion --top-k 30", {"sampling.top_k": 30}),
    ("llama-completion --top-p 0.95", {"sampling.top_p": 0.95}),
    ("llama-completion --min-p 0.05", {"sampling.min_p": 0.05}),
    ("llama-completion --repeat-penalty 1.5 --repeat-last-n 0", {"sampling.repeat_penalty": 1.5,
                                                                 "sampling.repeat_last_n": 0}),
    ("llama-completion --presence-penalty 0.5 --frequency-penalty 0.25",
     {"sampling.presence_penalty": 0.5, "sampling.frequency_penalty": 0.25}),
    ("llama-completion --logit-bias 15043+1", {"sampling.logit_bias": ((15043, 1.0),)}),
    ("llama-completion --logit-bias 15043-1", {"sampling.logit_bias": ((15043, -1.0),)}),
    ("llama-completion -l 29905-inf", {"sampling.logit_bias": ((29905, -math.inf),)}),
    ("llama-completion -s 42", {"sampling.seed": 42}),
    ("llama-completion --keep -1 --context-shift", {"n_keep": -1, "context_shift": True}),
    ("llama-completion -c 0", {"n_ctx": 0}),
    ("llama-completion --verbose-prompt --no-display-prompt", {"verbose_prompt": True, "display_prompt": False}),
    ("llama-completion -t 8 -tb 16", {"threads": 8, "threads_batch": 16}),
    ("llama-completion -b 1024 -ub 256", {"n_batch": 1024, "n_ubatch": 256}),
    ("llama-completion -sp --no-escape -p 'a\\nb'", {"special": True, "escape": False, "prompt": "a\\nb"}),
    # tools/completion/completion.cpp, print_usage
    ("llama-completion -m your_model.gguf -p 'I believe the meaning of life is' -n 128 -no-cnv",
     {"prompt": "I believe the meaning of life is", "n_predict": 128, "conversation": False}),
    ("llama-completion -m your_model.gguf -sys 'You are a helpful assistant'",
     {"system_prompt": "You are a helpful assistant", "conversation": None, "prompt": None}),
    # tools/cli/README.md and tools/completion/README.md, options table
    ("llama-cli -fa on -ctk q8_0 -ctv q4_0", {"flash_attn": True, "type_k": DType.Q8_0, "type_v": DType.Q4_0}),
    ("llama-cli -fa off", {"flash_attn": False}),
    ("llama-cli -fa auto -ngl auto", {"flash_attn": True, "n_gpu_layers": o.GPU_LAYERS_ALL}),
    ("llama-cli --flash-attn off -ngl all", {"flash_attn": False, "n_gpu_layers": o.GPU_LAYERS_ALL}),
    ("llama-cli -ngl -1 -e", {"n_gpu_layers": o.GPU_LAYERS_ALL, "escape": True}),
    ("llama-cli --chat-template chatml -cnv -st", {"chat_template": "chatml", "conversation": True,
                                                  "single_turn": True}),
    # docs/build.md
    ('llama-cli -m "[PATH TO MODEL]" -ngl 100 -c 16384 -t 10 -n -2 -cnv',
     {"n_gpu_layers": 100, "n_ctx": 16384, "threads": 10, "n_predict": -2, "conversation": True}),
    ('llama-cli -m "PATH_TO_MODEL" -p "Hi you how are you" -ngl 99', {"prompt": "Hi you how are you", "n_gpu_layers": 99}),
    ('llama-cli -m PATH_TO_MODEL -p "Building a website can be done in 10 steps:" -ngl 32',
     {"prompt": "Building a website can be done in 10 steps:", "n_gpu_layers": 32}),
    ('llama-cli -m PATH_TO_MODEL -p "Building a website can be done in 10 steps:" -n 50', {"n_predict": 50}),
    ('llama-cli -m PATH_TO_MODEL -p "What is a car?"', {"prompt": "What is a car?", "n_predict": -1, "n_ctx": 0}),
    # docs/docker.md
    ('llama-completion -m /models/32B/ggml-model-q8_0.gguf -no-cnv -p "Building a mobile app can be done in 15 steps:" -n 512',
     {"conversation": False, "n_predict": 512, "prompt": "Building a mobile app can be done in 15 steps:"}),
    # docs/android.md (with its placeholders filled in)
    ('llama-cli -m ~/model.gguf -c 4096 -p "your prompt"', {"n_ctx": 4096, "prompt": "your prompt"}),
    # docs/multi-gpu.md (-sm tensor left out)
    ("llama-cli -m model.gguf -ctk f16 -ctv f16", {"type_k": DType.F16, "type_v": DType.F16}),
    ("llama-cli -m model.gguf", {"split": DeviceSplit(devices=None, mode="layer", tensor_split=(), main_gpu=0)}),
    ("llama-cli -m model.gguf -ts 3,1", {"split.tensor_split": (3.0, 1.0), "split.mode": "layer"}),
    ("llama-cli -m model.gguf -dev CUDA1", {"split.devices": ("CUDA1",), "split.main_gpu": 0}),
    # common/arg.cpp's long option names, and '/' between -ts's proportions (lines written here, not copied)
    ("llama-cli --split-mode row --main-gpu 1 --tensor-split 1/2 --device CUDA0,CUDA1",
     {"split": DeviceSplit(devices=("CUDA0", "CUDA1"), mode="row", tensor_split=(1.0, 2.0), main_gpu=1)}),
    ("llama-cli -sm none -mg 1 -dev none", {"split.mode": "none", "split.main_gpu": 1, "split.devices": ()}),
    # docs/build-riscv64-spacemit.md
    ("llama-cli -m Qwen2.5-0.5B-Instruct-Q4_0.gguf -t 1", {"threads": 1}),
    # examples/convert-llama2c-to-ggml/README.md
    ('llama-cli -m stories42M.gguf.bin -p "One day, Lily met a Shoggoth" -n 500 -c 256',
     {"prompt": "One day, Lily met a Shoggoth", "n_predict": 500, "n_ctx": 256}),
    # docs/development/token_generation_performance_tips.md
    ('llama-cli -m "path/to/model.gguf" -ngl 200000 -p "Please sir, may I have some "',
     {"n_gpu_layers": 200000, "prompt": "Please sir, may I have some "}),
    # docs/backend/snapdragon/README.md and linux.md (--split-mode and --device left out)
    ("llama-completion -m models/gemma-2-2b-it-Q4_0.gguf -f prompts/sample_prompt_1024.txt --jinja -st",
     {"prompt_file": "prompts/sample_prompt_1024.txt", "single_turn": True, "prompt": None}),
    ("llama-completion -m models/gemma-2b-it-Q4_0.gguf -f prompts/sample_prompt_1024.txt --jinja -st --ctx-size 8192 "
     "-v -n 16 -ngl 99 --ubatch-size 1024 -fa on -t 6",
     {"n_ctx": 8192, "verbose": True, "n_predict": 16, "n_gpu_layers": 99, "n_ubatch": 1024, "flash_attn": True,
      "threads": 6}),
    # tools/cvector-generator/README.md (--control-vector-* left out): escapes and special tokens in -p
    ('llama-cli -m ./llama-3.Q4_K_M.gguf -p "<|start_header_id|>system<|end_header_id|>\\n\\nYou are a helpful '
     'assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\\n\\nSing a song<|im_end|><|eot_id|>'
     '<|start_header_id|>assistant<|end_header_id|>\\n\\n" --special',
     {"special": True, "prompt": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nSing a song<|im_end|><|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n"}),
]


def parse(cmdline: str) -> RunSettings:
    """The settings of a llama.cpp command line as `ggrun run` reads it (the program name dropped)."""
    return parse_settings(run_settings, shlex.split(cmdline)[1:])


def value(settings: RunSettings, path: str):
    for part in path.split("."):
        settings = getattr(settings, part)
    return settings


@pytest.mark.parametrize("cmdline, meaning", CASES, ids=[c for c, _ in CASES])
def test_llama_cpp_command_line_means_the_same(cmdline, meaning):
    s = parse(cmdline)
    for path, expected in meaning.items():
        assert value(s, path) == expected, path


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 25


def test_defaults_are_llama_cpps():
    """Nothing given: the model's training context, generation until the end of text, conversation when
    the model has a template, llama.cpp's sampler defaults, f16 KV cache, escapes processed."""
    s = parse("llama-completion")
    assert (s.n_ctx, s.n_predict, s.conversation, s.n_batch, s.n_ubatch) == (0, -1, None, 2048, 512)
    assert (s.type_k, s.type_v, s.flash_attn, s.escape, s.display_prompt) == (DType.F16, DType.F16, True, True, True)
    p = s.sampling
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n, p.seed) == \
        (0.8, 40, 0.95, 0.05, 1.0, 64, -1)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.0, 0.0, ())


def test_multi_letter_short_options_are_not_split():
    """`-cnv` is not `-c nv`, `-ctk` not `-c tk`, `-sys` and `-st` not `-s ...`, `-tb` not `-t b`."""
    s = parse("x -cnv -ctk q8_0 -sys hello -st -tb 3 -c 128 -s 7 -t 2")
    assert (s.conversation, s.type_k, s.system_prompt, s.single_turn) == (True, DType.Q8_0, "hello", True)
    assert (s.threads_batch, s.n_ctx, s.sampling.seed, s.threads) == (3, 128, 7, 2)


def test_the_old_chat_flag_is_conversation_mode():
    assert parse("x --chat").conversation is True
    assert parse("x --no-conversation").conversation is False


def test_escapes_apply_to_prompt_prefix_suffix_and_reverse_prompts_not_the_system_prompt():
    s = parse(r"x -p 'a\tb\x41\q' --in-prefix '\n' --in-suffix 'A:\n' -r 'User:\n' -sys 'keep\n'")
    assert (s.prompt, s.in_prefix, s.in_suffix, s.reverse_prompts) == ("a\tbA\\q", "\n", "A:\n", ("User:\n",))
    assert s.system_prompt == "keep\\n"


def test_process_escapes_matches_llama_cpp():
    assert process_escapes(r"\n\r\t\'\"\\") == "\n\r\t'\"\\"
    assert process_escapes(r"\x41\x4g\z\\") == "A\\x4g\\z\\"
    assert process_escapes("\\") == "\\"
    assert process_escapes(r"caf\xc3\xa9") == "café"  # \xNN are bytes, as in C++


def test_prompt_file_is_read_without_its_last_newline_and_with_escapes(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("line\\tone\n\n", encoding="utf-8")
    assert parse(f"x -f {f}").prompt_text() == "line\tone\n"
    assert parse(f"x -f {f} --no-escape").prompt_text() == "line\\tone\n"


@pytest.mark.parametrize("cmdline, fragment", [
    ("x -n -3", "-n -3"),
    ("x -c -1", "-c -1"),
    ("x -ub 0", "-ub 0"),
    ("x --keep -2", "--keep -2"),
    ("x -p a -f b", "either -p or -f"),
    ("x -tb 0", "-tb 0"),
    ("x --top-p 2", "--top-p"),
    ("x -l 12x3", "--logit-bias"),
    ("x -sm tensor", "-sm tensor"),
    ("x -ts 1,-1", "-ts 1,-1"),
    ("x -mg -1", "-mg -1"),
    ("x -dev ''", "-dev"),
])
def test_values_that_cannot_work_are_bad_input(cmdline, fragment):
    with pytest.raises(BadInput, match=fragment):
        parse(cmdline)


@pytest.mark.parametrize("args, fragment", [
    (["-fa", "maybe"], "'-fa'"),
    (["-ngl", "x"], "'-ngl'"),
    (["-ctk", "q9_9"], "'-ctk'"),
    (["-ctv", "iq4_nl"], "iq4_nl"),
    (["-n", "-3"], "-n -3"),
    (["-l", "1+x"], "--logit-bias"),
])
def test_bad_values_through_the_command_are_one_line_and_exit_2(capsys, monkeypatch, args, fragment):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", "nowhere.gguf", *args)
    assert code == 2 and out == "", err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and fragment in err, err
