"""Command-line options shared by ggrun's commands, spelled as in llama.cpp's tools."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

Model = Annotated[Optional[str], typer.Option("-m", "--model", help="GGUF file or known model name (default: SmolLM2-135M-Instruct, downloaded once)")]
Prompt = Annotated[Optional[str], typer.Option("-p", "--prompt", help="Prompt text")]
File = Annotated[Optional[str], typer.Option("-f", "--file", help="Read the prompt from this file")]
NPredict = Annotated[int, typer.Option("-n", "--n-predict", help="Number of tokens to generate (0: evaluate the prompt only)")]
Ctx = Annotated[int, typer.Option("-c", "--ctx-size", help="Context size in tokens")]
BatchSize = Annotated[int, typer.Option("-b", "--batch-size", help="Logical batch size: prompt tokens per decode call")]
UBatchSize = Annotated[int, typer.Option("-ub", "--ubatch-size", help="Physical batch size: tokens per graph (micro-batch)")]
GpuLayers = Annotated[int, typer.Option("-ngl", "--n-gpu-layers", help="Layers to offload to the first device backend (the last N; more than the layer count offloads the output head too)")]
Seed = Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1: random)")]
Temp = Annotated[float, typer.Option("--temp", help="Temperature (0: greedy)")]
TopK = Annotated[int, typer.Option("--top-k", help="Top-k sampling (0: off)")]
TopP = Annotated[float, typer.Option("--top-p", help="Top-p sampling (1.0: off)")]
MinP = Annotated[float, typer.Option("--min-p", help="Min-p sampling (0.0: off)")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for repeated tokens (1.0: off)")]
RepeatLastN = Annotated[int, typer.Option("--repeat-last-n", help="Tokens considered by the repetition penalty (-1: context)")]
ListDevices = Annotated[bool, typer.Option("--list-devices", help="List the backends usable on this machine and exit")]
NoGraphReuse = Annotated[bool, typer.Option("--no-graph-reuse", help="Rebuild and replan the graph for every micro-batch")]
Verbose = Annotated[bool, typer.Option("-v", "--verbose", help="More logging on stderr")]
Threads = Annotated[Optional[int], typer.Option("-t", "--threads", help="CPU threads for matrix products (default: all cores)")]
FlashAttn = Annotated[bool, typer.Option("--flash-attn/--no-flash-attn", "-fa/-no-fa", help="Fused attention (default): no score matrix in the compute buffer, and on the CPU faster; --no-flash-attn computes the scores")]
Numerics = Annotated[str, typer.Option("--numerics", help="llama: round operands as llama.cpp's CPU kernels do (agrees with its numbers); f32: plain f32 (results independent of batching)")]
CheckNumerics = Annotated[bool, typer.Option("--check-numerics", help="On NaN or infinite logits, recompute the graph node by node and name the first node that produced one (also GGRUN_GRAPH_DEBUG=1)")]
