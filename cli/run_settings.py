"""What a `ggrun run` command line means, as one record: `run_settings` declares the command's options
(llama.cpp's, for llama-cli and llama-completion) and turns them into a RunSettings before any model is
loaded, so that a command line's meaning can be checked (cli.cmdline.parse_settings) without running it.

Values keep llama.cpp's conventions: `n_ctx` 0 is the model's training context, `n_predict` -1 is
"until the end of text" and -2 "until the context is full", `conversation` None is "on when the model
has a chat template". Files named by -f, -sysf and --chat-template-file are read when the run starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import typer

from ggrun.cli import options as o
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.llm.generate import check_n_predict
from ggrun.core.llm.placement import DeviceSplit
from ggrun.core.llm.sampling import SamplingParams


@dataclass(frozen=True)
class RunSettings:
    model: str | None = None
    prompt: str | None = None  # -p, escapes processed
    prompt_file: str | None = None  # -f (read, and its escapes processed, by prompt_text())
    system_prompt: str | None = None  # -sys
    system_prompt_file: str | None = None  # -sysf
    n_predict: int = -1
    n_ctx: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    n_gpu_layers: int = 0
    split: DeviceSplit = field(default_factory=DeviceSplit)  # -dev, -sm, -ts, -mg
    threads: int | None = None
    threads_batch: int | None = None
    poll: int | None = None  # --poll: None, the default level
    numerics: str = "llama"
    type_k: DType = DType.F16
    type_v: DType = DType.F16
    flash_attn: bool = True
    conversation: bool | None = None
    interactive: bool = False
    interactive_first: bool = False
    single_turn: bool = False
    reverse_prompts: tuple[str, ...] = ()
    in_prefix: str = ""
    in_suffix: str = ""
    escape: bool = True
    display_prompt: bool = True
    verbose_prompt: bool = False
    special: bool = False
    chat_template: str | None = None  # a built-in name or Jinja source
    chat_template_file: str | None = None
    ignore_eos: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context_shift: bool = False
    n_keep: int = 0
    graph_reuse: bool = True
    check_numerics: bool = False
    check_tensors: bool = False
    verbose: bool = False
    list_devices: bool = False

    @property
    def use_chat_template(self) -> bool:
        """llama.cpp turns the chat template off when --in-prefix or --in-suffix is given."""
        return not (self.in_prefix or self.in_suffix)

    def prompt_text(self) -> str | None:
        """The prompt: -p as given, or -f's text without its last newline (escapes processed as for -p);
        None when neither was given."""
        if self.prompt_file is None:
            return self.prompt
        text = _strip_last_newline(read_text(self.prompt_file))
        return process_escapes(text) if self.escape else text

    def system_prompt_text(self) -> str | None:
        if self.system_prompt_file is not None:
            return _strip_last_newline(read_text(self.system_prompt_file))
        return self.system_prompt

    def chat_template_source(self) -> str | None:
        """--chat-template-file's text, or --chat-template (a name or Jinja), or None for the model's."""
        if self.chat_template_file is not None:
            return read_text(self.chat_template_file)
        return self.chat_template


def run_settings(
    model: o.Model = None, prompt: o.Prompt = None, file: o.File = None, system_prompt: o.SystemPrompt = None,
    system_prompt_file: o.SystemPromptFile = None, n_predict: o.NPredict = -1, ctx_size: o.Ctx = 0,
    batch_size: o.BatchSize = 2048, ubatch_size: o.UBatchSize = 512, n_gpu_layers: o.GpuLayers = 0,
    device: o.Devices = None, split_mode: o.SplitMode = "layer", tensor_split: o.TensorSplit = None,
    main_gpu: o.MainGpu = 0, threads: o.Threads = None, threads_batch: o.ThreadsBatch = None, poll: o.Poll = None,
    numerics: o.Numerics = "llama",
    cache_type_k: o.CacheTypeK = DType.F16, cache_type_v: o.CacheTypeV = DType.F16,
    flash_attn: o.FlashAttnMode = "auto", no_flash_attn: o.NoFlashAttn = False,
    conversation: o.Conversation = None, interactive: o.Interactive = False,
    interactive_first: o.InteractiveFirst = False, single_turn: o.SingleTurn = False,
    reverse_prompt: o.ReversePrompt = None, in_prefix: o.InPrefix = "", in_suffix: o.InSuffix = "",
    escape: o.Escape = True, display_prompt: o.DisplayPrompt = True, verbose_prompt: o.VerbosePrompt = False,
    special: o.Special = False, chat_template: o.ChatTemplate = None, chat_template_file: o.ChatTemplateFile = None,
    jinja: o.Jinja = False, ignore_eos: o.IgnoreEos = False, seed: o.Seed = -1, temp: o.Temp = 0.8,
    top_k: o.TopK = 40, top_p: o.TopP = 0.95, min_p: o.MinP = 0.05, repeat_penalty: o.RepeatPenalty = 1.0,
    repeat_last_n: o.RepeatLastN = 64, presence_penalty: o.PresencePenalty = 0.0,
    frequency_penalty: o.FrequencyPenalty = 0.0, logit_bias: o.LogitBias = None,
    context_shift: o.ContextShift = False, n_keep: o.Keep = 0, list_devices_: o.ListDevices = False,
    no_graph_reuse: o.NoGraphReuse = False, check_numerics: o.CheckNumerics = False, check_tensors: o.CheckTensors = False,
    verbose: o.Verbose = False,
) -> RunSettings:
    """Generate text from a prompt, or chat (like llama-completion and llama-cli)."""
    if prompt is not None and file is not None:
        raise BadInput("give either -p or -f, not both")
    if system_prompt is not None and system_prompt_file is not None:
        raise BadInput("give either -sys or -sysf, not both")
    if ctx_size < 0:
        raise BadInput(f"-c {ctx_size} must not be negative (0: the model's training context)")
    for name, v in (("-b", batch_size), ("-ub", ubatch_size)):
        if v < 1:
            raise BadInput(f"{name} {v} must be positive")
    for name, v in (("-t", threads), ("-tb", threads_batch)):
        if v is not None and v < 1:
            raise BadInput(f"{name} {v} must be positive")
    o.check_poll(poll)
    check_n_predict(n_predict)
    if n_keep < -1:
        raise BadInput(f"--keep {n_keep}: give a number of tokens, or -1 for the whole prompt")
    split = o.device_split(device, split_mode, tensor_split, main_gpu)
    esc = process_escapes if escape else (lambda text: text)
    try:
        bias = tuple(o.parse_logit_bias(b) for b in logit_bias or ())
    except typer.BadParameter as err:
        raise BadInput(f"--logit-bias {err}") from None
    sampling = SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
                              presence_penalty, frequency_penalty, bias)
    sampling.check()
    return RunSettings(
        model=model, prompt=None if prompt is None else esc(prompt), prompt_file=file,
        system_prompt=system_prompt, system_prompt_file=system_prompt_file, n_predict=n_predict, n_ctx=ctx_size,
        n_batch=batch_size, n_ubatch=ubatch_size, n_gpu_layers=n_gpu_layers, split=split, threads=threads,
        threads_batch=threads_batch, poll=poll, numerics=numerics, type_k=cache_type_k, type_v=cache_type_v,
        flash_attn=flash_attn != "off" and not no_flash_attn, conversation=conversation, interactive=interactive,
        interactive_first=interactive_first, single_turn=single_turn,
        reverse_prompts=tuple(esc(r) for r in reverse_prompt or ()), in_prefix=esc(in_prefix),
        in_suffix=esc(in_suffix), escape=escape, display_prompt=display_prompt, verbose_prompt=verbose_prompt,
        special=special, chat_template=chat_template, chat_template_file=chat_template_file, ignore_eos=ignore_eos,
        sampling=sampling, context_shift=context_shift, n_keep=n_keep, graph_reuse=not no_graph_reuse,
        check_numerics=check_numerics, check_tensors=check_tensors, verbose=verbose,
        list_devices=list_devices_)


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes: \\n \\r \\t \\' \\" \\\\ and \\xNN; any other backslash stays."""
    simple = {"n": b"\n", "r": b"\r", "t": b"\t", "'": b"'", '"': b'"', "\\": b"\\"}
    if "\\" not in text:
        return text
    out = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            hex_digits = text[i + 2:i + 4]
            if nxt in simple:
                out += simple[nxt]
                i += 2
                continue
            if nxt == "x" and len(hex_digits) == 2 and all(c in "0123456789abcdefABCDEF" for c in hex_digits):
                out.append(int(hex_digits, 16))
                i += 4
                continue
            out += ("\\" + nxt).encode("utf-8")
            i += 2
            continue
        out += ch.encode("utf-8")
        i += 1
    return out.decode("utf-8", "replace")


def read_text(file: str) -> str:
    path = Path(file)
    if not path.is_file():
        raise BadInput(f"{file}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{file}: not UTF-8 text") from None


def _strip_last_newline(text: str) -> str:
    return text[:-1] if text.endswith("\n") else text
