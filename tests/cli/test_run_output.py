"""What `ggrun run` prints, against goldens shaped like llama-completion's output (measured with
llama.cpp's build on SmolLM2): the prompt echoed before the text unless --no-display-prompt,
` [end of text]` when the model ends the text, the sampler seed and the run's shape before generating,
and llama.cpp's timing block at the end, all on tiny synthetic models. Conversation mode through
piped stdin: `> ` before each turn, the turn echoed, one figures line per reply on stderr."""
from __future__ import annotations

import io
import re
import sys

import pytest

from ggrun.loaders.synthetic import EOT, tiny_bpe_vocab, write_tiny_llama
from tests.cli.runner import ggrun
from tests.cli.test_cli_run import _text_of
from tests.llm.llama_reference import ReferenceLlama

EOT_ID = tiny_bpe_vocab()[0].index(EOT)
CHAT_TEMPLATE = ("{% for m in messages %}<|reserved_0|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|reserved_0|>assistant\n{% endif %}")

# llama-completion's block (common_perf_print), numbers replaced by F; "ggrun:" stands where it writes its function name
TIMING_GOLDEN = """\
ggrun:     sampling time = F ms /     4 tokens
ggrun:         load time = F ms
ggrun:  prompt eval time = F ms /     2 tokens ( F ms per token, F tokens per second)
ggrun:         eval time = F ms /     3 runs   ( F ms per token, F tokens per second)
ggrun:        total time = F ms /     5 tokens
ggrun:  unaccounted time = F ms / F %      (total - sampling - prompt eval - eval) / (total)
ggrun:     graphs reused =          2 (built 2)"""


def floats_out(text: str) -> str:
    return re.sub(r" +-?\d+\.\d+", " F", text)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny llama with a ChatML-like template: <|reserved_0|> opens a turn, <|endoftext|> ends it."""
    return write_tiny_llama(tmp_path_factory.mktemp("chat") / "chat.gguf", n_vocab=EOT_ID + 2,
                            extra_metadata={"tokenizer.chat_template": CHAT_TEMPLATE})


def tiny_tokenizer(path):
    """Token count of a text (special tokens parsed) in a tiny model's vocabulary."""
    from ggrun.loaders.gguf_file import open_gguf
    from ggrun.loaders.tokenizer import Tokenizer

    with open_gguf(path) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    return lambda text: len(tok.tokenize(text, add_special=False, parse_special=True))


def greedy_text(path, prompt: str, n: int) -> str:
    return _text_of(ReferenceLlama.load(path).greedy([ord(c) for c in prompt], n))


def test_completion_echoes_the_prompt_and_ends_with_the_timing_block(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "-n", "4", "--temp", "0",
                           "-s", "7")
    assert code == 0, err
    assert out == "hi" + greedy_text(tiny_llama_path, "hi", 4) + "\n"
    lines = err.splitlines()
    assert lines[:2] == ["ggrun: sampler seed: 7", "ggrun: generate: n_ctx = 256, n_batch = 2048, n_predict = 4, n_keep = 0"]
    assert floats_out("\n".join(lines[2:])) == TIMING_GOLDEN


def test_no_display_prompt_prints_only_the_generated_text(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "-n", "4", "--temp", "0",
                           "--no-display-prompt")
    assert code == 0, err
    assert out == greedy_text(tiny_llama_path, "hi", 4) + "\n"


def test_end_of_generation_prints_end_of_text(capsys, monkeypatch, tiny_llama_path):
    """A logit bias makes <|endoftext|> the first choice: the text ends there, as llama-completion says it."""
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "--temp", "0",
                           "-l", f"{EOT_ID}+100")
    assert code == 0, err
    assert out == "hi [end of text]\n"
    assert "eval time = F ms /     0 runs" in floats_out(err)


def test_ignore_eos_overrides_a_bias_towards_the_end(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "--temp", "0", "-n", "3",
                           "-l", f"{EOT_ID}+100", "--ignore-eos")
    assert code == 0, err
    assert "[end of text]" not in out and out.startswith("hi") and "/     3 tokens" in err


def test_zero_predict_echoes_the_prompt_only(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hello", "-n", "0")
    assert code == 0, err
    assert out == "hello\n"
    assert "eval time = F ms /     0 runs" in floats_out(err)


def test_a_random_seed_is_printed(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "-n", "1")
    assert code == 0, err
    seed = int(re.search(r"^ggrun: sampler seed: (\d+)$", err, re.M).group(1))
    assert 0 <= seed < 2**32


def test_prompt_is_tokenized_with_special_tokens_and_escapes(capsys, monkeypatch, tiny_llama_path):
    r"""As llama-completion: control-token text in -p becomes the token (<|endoftext|> is one id), and \n
    is a newline; --verbose-prompt lists the ids as llama.cpp does, before the seed line."""
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", r"hi<|endoftext|>a\nb", "-n", "0",
                           "--verbose-prompt")
    assert code == 0, err
    listed = re.findall(r"^\s*(\d+) -> '", err, flags=re.M)
    assert listed == ["104", "105", str(EOT_ID), "97", "10", "98"]
    assert err.index("number of tokens in prompt = 6") < err.index("sampler seed")
    assert out == "hia\nb\n"  # the control token is not printed (no -sp)


def test_special_prints_control_tokens(capsys, monkeypatch, tiny_llama_path):
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi<|endoftext|>", "-n", "0", "-sp")
    assert code == 0, err
    assert out == "hi<|endoftext|>\n"


def test_reverse_prompt_stops_the_text(capsys, monkeypatch, tiny_llama_path):
    """-r with the text of the greedy continuation's second token: generation stops right after it."""
    ref = ReferenceLlama.load(tiny_llama_path).greedy([ord("h"), ord("i")], 6)
    stop_at = _text_of(ref[1:2])
    assert stop_at.strip() and stop_at not in "hi" + _text_of(ref[:1])
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "-n", "6", "--temp", "0",
                           "-r", stop_at, "--no-display-prompt")
    assert code == 0, err
    assert out == _text_of(ref[:2]) + "\n"


def test_conversation_through_piped_stdin(capsys, monkeypatch, chat_model):
    """`echo ... | ggrun run -cnv`: each line is a turn; the second evaluates only its own tokens (the cache
    holds the first turn, its reply, and nothing is evaluated twice)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nworld\n"))
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", chat_model, "-n", "4", "--temp", "0", "--ignore-eos")
    assert code == 0, err
    assert "enabling conversation mode" in err
    turns = re.findall(r"^\[ Prompt: (\d+) new tokens, (\d+) cached, [\d.]+ t/s \| Generation: (\d+) tokens", err, re.M)
    assert len(turns) == 2, err
    (new1, cached1, gen1), (new2, cached2, gen2) = [tuple(map(int, t)) for t in turns]
    n_tokens = tiny_tokenizer(chat_model)
    assert (new1, cached1, gen1) == (n_tokens("<|reserved_0|>user\nhello<|endoftext|>\n<|reserved_0|>assistant\n"), 0, 4)
    # turn 2: the reply's last token (sampled, never decoded), the <|endoftext|> that closes the cut reply,
    # then the template's text for the new turn; everything before is cached
    turn2 = n_tokens("\n<|reserved_0|>user\nworld<|endoftext|>\n<|reserved_0|>assistant\n")
    assert (new2, cached2) == (1 + 1 + turn2, new1 + gen1 - 1)
    replies = re.findall(r"^> (\w+)\n(.*)\n$", out, re.M)
    assert [r[0] for r in replies] == ["hello", "world"]
    assert out.endswith("\n> \n")  # end of input


def test_single_turn_answers_the_prompt_and_exits(capsys, monkeypatch, chat_model):
    monkeypatch.setattr(sys, "stdin", io.StringIO("never read\n"))
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", chat_model, "-p", "hello", "-st", "-n", "3", "--temp", "0",
                           "--ignore-eos", "-sys", "be brief")
    assert code == 0, err
    assert out.startswith("> hello\n") and "never read" not in out and out.count("> ") == 1
    assert "/     3 tokens" in err


def test_conversation_without_a_template_falls_back_to_chatml(capsys, monkeypatch, tiny_llama_path):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-cnv", "-p", "hi", "-st", "-n", "2",
                           "--verbose-prompt", "--ignore-eos")
    assert code == 0, err
    assert "no chat template; conversation mode uses chatml" in err
    pieces = "".join(re.findall(r"^\s*\d+ -> '(.*)'$", err, flags=re.M))
    assert pieces.startswith("<|im_start|>user")  # chatml's markers, as text: the tiny vocabulary lacks them


@pytest.mark.slow
def test_smollm2_chatml_prompt_gives_llama_cpps_ids_and_the_training_context(capsys, monkeypatch, smollm2_path):
    r"""A ChatML-formatted -p (escapes in it, as typed in a shell) gives SmolLM2's control tokens: the ids
    llama-tokenize prints for it (15, where spelling the markers out as text would give 30); the default
    -c 0 is the model's training context, 8192, as llama-completion's n_ctx."""
    prompt = r"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", smollm2_path, "-no-cnv", "-p", prompt, "-n", "0",
                           "--verbose-prompt", "-t", "1")
    assert code == 0, err
    ids = [int(i) for i in re.findall(r"^\s*(\d+) -> '", err, flags=re.M)]
    assert ids == [1, 9690, 198, 2683, 359, 5356, 30, 2, 198, 1, 4093, 198, 26843, 2, 198]  # llama-tokenize
    assert "generate: n_ctx = 8192," in err
    assert out == "system\nYou are helpful.\nuser\nHi\n\n"  # echoed without the control tokens, as llama.cpp


def test_threads_batch_is_used_for_prompts_and_threads_for_generation(capsys, monkeypatch, tiny_llama_path):
    from ggrun.cli import conversation

    calls: list[int | None] = []
    monkeypatch.setattr(conversation, "set_threads", calls.append)
    code, out, err = ggrun(capsys, monkeypatch, "run", "-m", tiny_llama_path, "-p", "hi", "-n", "2", "-t", "1",
                           "-tb", "2")
    assert code == 0, err
    assert calls == [2, 1]
