"""Command-line options shared by ggrun's commands, spelled as in llama.cpp's tools (common/arg.cpp),
with the parsers that turn llama.cpp's spellings of a value (`-ngl all`, `-fa on`, `-ctk q8_0`) into
the value a command uses. Multi-letter short options (`-cnv`, `-ctk`, `-sys`) are declared whole, so
the parser matches them before it would split them into single letters."""
from __future__ import annotations

import math
import re
from typing import Annotated, Optional

import typer

from ggrun.core.backends.cpu.threads import MAX_POLL
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.llm.placement import DeviceSplit

GPU_LAYERS_ALL = 2**31 - 1  # -ngl all / auto / -1: every layer and the output head

# KV cache types llama.cpp's -ctk / -ctv accept (common/arg.cpp); a session refuses those it lacks kernels for
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def parse_gpu_layers(value: str) -> int:
    """-ngl N, or 'auto', 'all' or -1 for every layer (llama.cpp's auto offloads all that fits)."""
    if isinstance(value, int):  # a default, already a layer count
        return value
    if value in ("auto", "all", "-1"):
        return GPU_LAYERS_ALL
    try:
        n = int(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r}: give a number of layers, 'auto' or 'all'") from None
    if n < 0:
        raise typer.BadParameter(f"{value}: give a number of layers, 'auto' or 'all' (or -1)")
    return n


def parse_tensor_split(value: str) -> tuple[float, ...]:
    """-ts 3,1 (or 3/1, as llama.cpp also reads it): a proportion per device, not negative."""
    try:
        parts = tuple(float(x) for x in re.split(r"[,/]+", value.strip()) if x)
    except ValueError:
        raise BadInput(f"-ts {value}: give proportions per device, e.g. 3,1") from None
    if not parts or any(x < 0 or not math.isfinite(x) for x in parts):
        raise BadInput(f"-ts {value}: give proportions per device (not negative), e.g. 3,1")
    return parts


def parse_devices(value: str) -> tuple[str, ...]:
    """-dev CUDA0,CUDA1 (or CUDA0/CUDA1): devices by name, in order; `none`: no device (the CPU only)."""
    names = tuple(x for x in re.split(r"[,/]+", value.strip()) if x)
    if names == ("none",):
        return ()
    if not names or "none" in names:
        raise BadInput(f"-dev {value}: give device names (see --list-devices), or none")
    return names


def device_split(devices: str | None, split_mode: str, tensor_split: str | None, main_gpu: int) -> DeviceSplit:
    """The record of -dev, -sm, -ts and -mg, checked as far as the command line alone allows (the
    devices themselves are checked when the model is placed)."""
    split = DeviceSplit(devices=None if devices is None else parse_devices(devices), mode=split_mode,
                        tensor_split=() if tensor_split is None else parse_tensor_split(tensor_split),
                        main_gpu=main_gpu)
    split.check()
    return split


def parse_on_off_auto(value: str) -> str:
    """llama.cpp's tri-state values (is_truthy / is_falsey / is_autoy) as 'on', 'off' or 'auto'."""
    if value in ("on", "enabled", "true", "1"):
        return "on"
    if value in ("off", "disabled", "false", "0"):
        return "off"
    if value in ("auto", "-1"):
        return "auto"
    raise typer.BadParameter(f"{value!r}: give on, off or auto")


def parse_cache_type(value: str) -> DType:
    if isinstance(value, DType):  # a default
        return value
    name = value.lower()
    if name not in CACHE_TYPES:
        raise typer.BadParameter(f"{value!r}: allowed values are {', '.join(CACHE_TYPES)}")
    from ggrun.core.llm.kv_cache import CACHE_TYPES as KV_CACHE_TYPES  # here: only a given -ctk/-ctv pays its import

    for dtype in KV_CACHE_TYPES:  # llama.cpp's others (iq4_nl, q5_0, ...) are weight types only here
        if dtype.label == name:
            return dtype
    raise typer.BadParameter(f"{value!r}: ggrun has no KV cache type {name} (use f16, f32, q8_0 or q4_0)")


def parse_logit_bias(value: str) -> tuple[int, float]:
    """-l TOKEN_ID(+/-)BIAS, as llama.cpp: `15043+1`, `15043-1`, `29905-inf`."""
    m = re.fullmatch(r"\s*(\d+)\s*([+-]\s*(?:inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?))\s*", value)
    if m is None:
        raise typer.BadParameter(f"{value!r}: give TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 29905-inf")
    bias = m.group(2).replace(" ", "")
    return int(m.group(1)), -math.inf if bias == "-inf" else math.inf if bias == "+inf" else float(bias)


Model = Annotated[Optional[str], typer.Option("-m", "--model", help="GGUF file or known model name (default: SmolLM2-135M-Instruct, downloaded once)")]
Prompt = Annotated[Optional[str], typer.Option("-p", "--prompt", help="Prompt text")]
File = Annotated[Optional[str], typer.Option("-f", "--file", help="Read the prompt from this file")]
NPredict = Annotated[int, typer.Option("-n", "--n-predict", "--predict", help="Number of tokens to generate (-1: until the end of text; -2: until the context is full; 0: evaluate the prompt only)")]
Ctx = Annotated[int, typer.Option("-c", "--ctx-size", help="Context size in tokens (0: the model's training context)")]
BatchSize = Annotated[int, typer.Option("-b", "--batch-size", help="Logical batch size: prompt tokens per decode call")]
UBatchSize = Annotated[int, typer.Option("-ub", "--ubatch-size", help="Physical batch size: tokens per graph (micro-batch)")]
GpuLayers = Annotated[int, typer.Option("-ngl", "--gpu-layers", "--n-gpu-layers", parser=parse_gpu_layers, metavar="N|auto|all", help="Layers to offload to the devices (the last N; more than the layer count, 'all', 'auto' or -1 offloads the output head too)")]
Devices = Annotated[Optional[str], typer.Option("-dev", "--device", metavar="DEV0,DEV1|none", help="Devices to offload to, by name and in order (see --list-devices), or none for the CPU only (default: every device)")]
SplitMode = Annotated[str, typer.Option("-sm", "--split-mode", metavar="none|layer|row", help="How to share the model over several devices: layer (whole layers and their KV cache per device, in proportion to -ts), row (each matrix of the offloaded layers split by rows; KV cache and the rest on -mg's device) or none (-mg's device only)")]
TensorSplit = Annotated[Optional[str], typer.Option("-ts", "--tensor-split", metavar="N0,N1,...", help="Proportion of the model per device, e.g. 3,1 (default: in proportion to each device's free memory)")]
MainGpu = Annotated[int, typer.Option("-mg", "--main-gpu", help="The device (index among those used) for -sm none, and where -sm row gathers results and keeps the KV cache")]
Seed = Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1: random)")]
Temp = Annotated[float, typer.Option("--temp", "--temperature", help="Temperature (0: greedy)")]
TopK = Annotated[int, typer.Option("--top-k", help="Top-k sampling (0: off)")]
TopP = Annotated[float, typer.Option("--top-p", help="Top-p sampling (1.0: off)")]
MinP = Annotated[float, typer.Option("--min-p", help="Min-p sampling (0.0: off)")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for repeated tokens (1.0: off)")]
RepeatLastN = Annotated[int, typer.Option("--repeat-last-n", help="Tokens considered by the repetition penalty (-1: context)")]
ListDevices = Annotated[bool, typer.Option("--list-devices", help="List the backends usable on this machine and exit")]
NoGraphReuse = Annotated[bool, typer.Option("--no-graph-reuse", help="Rebuild and replan the graph for every micro-batch")]
Verbose = Annotated[bool, typer.Option("-v", "--verbose", help="More logging on stderr")]
Threads = Annotated[Optional[int], typer.Option("-t", "--threads", help="CPU threads for matrix products (default: all cores)")]
Poll = Annotated[Optional[int], typer.Option("--poll", help="Polling level of idle CPU threads, 0..100 (0: they sleep at once; default: 50, as llama.cpp's)")]
Numerics = Annotated[str, typer.Option("--numerics", help="llama: round operands as llama.cpp's CPU kernels do (agrees with its numbers); f32: plain f32 (results independent of batching)")]
CheckTensors = Annotated[bool, typer.Option("--check-tensors", help="Check every tensor of the model for NaN and infinity before it runs (reads the whole file once; the small float tensors are always checked)")]
CheckNumerics = Annotated[bool, typer.Option("--check-numerics", help="On NaN or infinite logits, recompute the graph node by node and name the first node that produced one (also GGRUN_GRAPH_DEBUG=1)")]

# ---- run (llama-cli / llama-completion) ----------------------------------------------------------------------
FlashAttnMode = Annotated[str, typer.Option("-fa", "--flash-attn", parser=parse_on_off_auto, metavar="on|off|auto", help="Fused attention: no score matrix in the compute buffer, and on the CPU faster (auto: on)")]
NoFlashAttn = Annotated[bool, typer.Option("--no-flash-attn", "-no-fa", help="Same as -fa off: compute the attention scores")]
CacheTypeK = Annotated[DType, typer.Option("-ctk", "--cache-type-k", parser=parse_cache_type, metavar="TYPE", help=f"KV cache type for K ({', '.join(CACHE_TYPES)})")]
CacheTypeV = Annotated[DType, typer.Option("-ctv", "--cache-type-v", parser=parse_cache_type, metavar="TYPE", help=f"KV cache type for V ({', '.join(CACHE_TYPES)})")]
ThreadsBatch = Annotated[Optional[int], typer.Option("-tb", "--threads-batch", help="CPU threads while evaluating prompts (default: same as -t)")]
SystemPrompt = Annotated[Optional[str], typer.Option("-sys", "--system-prompt", help="System prompt for the chat template (conversation mode)")]
SystemPromptFile = Annotated[Optional[str], typer.Option("-sysf", "--system-prompt-file", help="Read the system prompt from this file")]
Conversation = Annotated[Optional[bool], typer.Option("-cnv/-no-cnv", "--conversation/--no-conversation", "--chat", help="Chat through the model's template, turn by turn (default: on when the model has a chat template)")]
Interactive = Annotated[bool, typer.Option("-i", "--interactive", help="After the text stops (end of text, -n, a reverse prompt, Ctrl-C), read more input and go on")]
InteractiveFirst = Annotated[bool, typer.Option("-if", "--interactive-first", help="Interactive, and wait for input before generating")]
SingleTurn = Annotated[bool, typer.Option("-st", "--single-turn", help="Conversation: answer one turn (the -p prompt, or one line of input), then exit")]
ReversePrompt = Annotated[Optional[list[str]], typer.Option("-r", "--reverse-prompt", help="Stop generating at this text (repeatable); interactive modes return control to you")]
InPrefix = Annotated[str, typer.Option("--in-prefix", help="Text put before each input in interactive mode (turns the chat template off)")]
InSuffix = Annotated[str, typer.Option("--in-suffix", help="Text put after each input in interactive mode (turns the chat template off)")]
Escape = Annotated[bool, typer.Option("-e/--no-escape", "--escape", help="Process escapes (\\n, \\r, \\t, \\', \\\", \\\\, \\xNN) in the prompt, --in-prefix/--in-suffix and -r (default: on)")]
DisplayPrompt = Annotated[bool, typer.Option("--display-prompt/--no-display-prompt", help="Print the prompt before the generated text (default: on)")]
VerbosePrompt = Annotated[bool, typer.Option("--verbose-prompt", help="Print the prompt's tokens to stderr before generating")]
Special = Annotated[bool, typer.Option("-sp", "--special", help="Print special (control) tokens in the generated text")]
ChatTemplate = Annotated[Optional[str], typer.Option("--chat-template", help="Chat template: Jinja source, or a built-in name (chatml, gemma, llama3, phi3, zephyr); default: the model's")]
ChatTemplateFile = Annotated[Optional[str], typer.Option("--chat-template-file", help="Read the Jinja chat template from this file")]
Jinja = Annotated[bool, typer.Option("--jinja", help="Accepted for llama.cpp's command lines: ggrun always renders chat templates with Jinja")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Never end at an end-of-generation token (a logit bias of -inf on them, as llama.cpp)")]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty", help="Subtracted once from the logit of each token in the last --repeat-last-n (0.0: off)")]
FrequencyPenalty = Annotated[float, typer.Option("--frequency-penalty", help="Subtracted per occurrence from the logit of tokens in the last --repeat-last-n (0.0: off)")]
LogitBias = Annotated[Optional[list[str]], typer.Option("-l", "--logit-bias", help="TOKEN_ID(+/-)BIAS added to a token's logit, e.g. 15043+1 or 29905-inf (repeatable)")]
Keep = Annotated[int, typer.Option("--keep", help="Prompt tokens a context shift keeps at the start (-1: the whole prompt; BOS is always kept)")]
ContextShift = Annotated[bool, typer.Option("--context-shift/--no-context-shift", help="When the context is full, discard half of the tokens after the kept ones and go on (default: stop there, with a notice)")]


def check_poll(poll: int | None) -> None:
    """--poll as llama.cpp takes it: a level from 0 to MAX_POLL (None: not given)."""
    if poll is not None and not 0 <= poll <= MAX_POLL:
        raise BadInput(f"--poll {poll} must be a level from 0 to {MAX_POLL}")
