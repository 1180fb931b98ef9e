"""`ggrun parallel`: many clients decoding at once over one model, one KV cache and one batched graph
per step, serving llama-parallel's requests (cli/parallel_prompts.py) with its options and its report:
a block per finished sequence, then its summary lines (prompt and generated tokens with their speeds
over the whole run, total speed, cache misses) and ggrun's graph reuse count.

As llama-parallel, the system prompt is part of every request unless -pps shares it (evaluated once,
its cells shared by every client); a response ends at "User:" (the next turn), an end-of-generation
token or -n tokens. Prompts are read in chunks of --prefill-chunk tokens per step (default -ub) beside the
generating clients' tokens. Results go to stdout (llama-parallel logs them to stderr), logs to stderr. Ctrl-C
prints the summary of the sequences finished so far (each was printed when it finished), then
`interrupted`, exit 130.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import typer

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.cmdline import command_from
from ggrun.cli.common import err_console, list_devices, load_model
from ggrun.cli.interrupt import Interrupt
from ggrun.cli.parallel_prompts import QUESTIONS, STOP_TEXT, SYSTEM_PROMPT, make_requests
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.placement import DeviceSplit
from ggrun.core.llm.parallel import STOP_CACHE, ParallelRunner, ParallelSummary, SequenceResult
from ggrun.core.llm.sampling import SamplingParams
from ggrun.core.llm.session import Session, SessionParams


@dataclass(frozen=True)
class ParallelSettings:
    """What a `ggrun parallel` command line asks for (llama-parallel's defaults)."""

    model: str | None = None
    n_parallel: int = 1
    n_sequences: int = 1
    n_predict: int = 128  # 0 or -1: until the response ends, within a share of the context
    n_ctx: int = 0  # 0: the model's training context
    n_batch: int = 2048
    n_ubatch: int = 512
    n_gpu_layers: int = 0
    split: DeviceSplit = DeviceSplit()  # -dev, -sm, -ts, -mg
    threads: int | None = None
    poll: int | None = None  # --poll: None, the default level
    numerics: str = "llama"
    type_k: DType = DType.F16
    type_v: DType = DType.F16
    flash_attn: bool = True
    file: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    shared_system: bool = False  # -pps: the system prompt evaluated once and shared
    system: bool = True  # False: --no-system-prompt
    n_junk: int = 1
    cont_batching: bool = True
    prefill_chunk: int = 0  # tokens per step while prompts are read (0: -ub)
    prefix_share: bool = True  # a prompt's beginning read once while another sequence holds it
    ignore_eos: bool = False
    json: bool = False
    graph_reuse: bool = True
    warmup: bool = True  # a decode of every client, twice, before the clock starts (ParallelRunner.warm_up)
    list_devices: bool = False


def settings(
    model: o.Model = None,
    n_parallel: int = typer.Option(1, "-np", "--parallel", help="Concurrent clients"),
    n_sequences: int = typer.Option(1, "-ns", "--sequences", help="Sequences to serve in total"),
    n_predict: int = typer.Option(128, "-n", "--n-predict", "--predict",
                                  help="Most tokens per response (0 or -1: until it ends by itself, within an "
                                       "equal share of the context per client)"),
    ctx_size: o.Ctx = 0, batch_size: o.BatchSize = 2048, ubatch_size: o.UBatchSize = 512,
    n_gpu_layers: o.GpuLayers = 0, device: o.Devices = None, split_mode: o.SplitMode = "layer",
    tensor_split: o.TensorSplit = None, main_gpu: o.MainGpu = 0, threads: o.Threads = None,
    poll: o.Poll = None, numerics: o.Numerics = "llama", cache_type_k: o.CacheTypeK = DType.F16, cache_type_v: o.CacheTypeV = DType.F16,
    flash_attn: o.FlashAttnMode = "auto", no_flash_attn: o.NoFlashAttn = False,
    file: Optional[str] = typer.Option(None, "-f", "--file", help="Questions, one per line (default: llama-parallel's)"),
    seed: o.Seed = -1, temp: o.Temp = 0.8, top_k: o.TopK = 40, top_p: o.TopP = 0.95, min_p: o.MinP = 0.05,
    repeat_penalty: o.RepeatPenalty = 1.0, repeat_last_n: o.RepeatLastN = 64,
    shared_system: bool = typer.Option(False, "-pps", help="Evaluate the system prompt once and share it (default: "
                                                             "part of every request, as llama-parallel)"),
    no_system: bool = typer.Option(False, "--no-system-prompt", help="Serve the requests without the system prompt"),
    junk: int = typer.Option(1, "--junk", help="Up to N-1 earlier question-and-answer turns before each question"),
    cont_batching: bool = typer.Option(True, "-cb/-nocb", "--cont-batching/--no-cont-batching",
                                       help="Start a new sequence as soon as a client is free (default), or only "
                                            "when all are"),
    prefill_chunk: int = typer.Option(0, "--prefill-chunk", help="Tokens per step while prompts are read "
                                      "(chunked prefill: the generating clients' tokens and up to this many in "
                                      "all, so a long prompt holds them up one chunk at a time; 0: -ub)"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate past end-of-generation tokens"),
    no_prefix_share: bool = typer.Option(False, "--no-prefix-share",
                                         help="Read every prompt whole (llama-parallel), rather than taking the "
                                              "cells of its beginning from a sequence that holds them"),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout: one per sequence, then a summary"),
    list_devices_: o.ListDevices = False, no_graph_reuse: o.NoGraphReuse = False,
    no_warmup: bool = typer.Option(False, "--no-warmup", help="Skip the untimed warm-up (one token of every "
                                   "client, twice, before the clock starts, as llama.cpp's warm-up decode)"),
) -> ParallelSettings:
    """Serve many sequences at once with continuous batching (like llama-parallel)."""
    if list_devices_:
        return ParallelSettings(list_devices=True)
    for flag, v in (("-np", n_parallel), ("-ns", n_sequences), ("-b", batch_size), ("-ub", ubatch_size)):
        if v < 1:
            raise BadInput(f"{flag} {v} must be positive")
    if n_predict < -1:
        raise BadInput(f"-n {n_predict}: give a number of tokens, or 0 / -1 for no limit")
    if ctx_size < 0:
        raise BadInput(f"-c {ctx_size} must not be negative (0: the model's training context)")
    if prefill_chunk < 0:
        raise BadInput(f"--prefill-chunk {prefill_chunk} must not be negative (0: -ub tokens per step)")
    if junk < 0:
        raise BadInput(f"--junk {junk} must not be negative")
    o.check_poll(poll)
    sampling = SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
    sampling.check()
    return ParallelSettings(
        model=model, n_parallel=n_parallel, n_sequences=n_sequences, n_predict=max(n_predict, 0), n_ctx=ctx_size,
        n_batch=batch_size, n_ubatch=ubatch_size, n_gpu_layers=n_gpu_layers,
        split=o.device_split(device, split_mode, tensor_split, main_gpu), threads=threads, poll=poll,
        numerics=numerics,
        type_k=cache_type_k, type_v=cache_type_v, flash_attn=flash_attn != "off" and not no_flash_attn, file=file,
        sampling=sampling, shared_system=shared_system, system=not no_system, n_junk=junk,
        cont_batching=cont_batching, prefill_chunk=prefill_chunk, prefix_share=not no_prefix_share,
        ignore_eos=ignore_eos, json=as_json, graph_reuse=not no_graph_reuse, warmup=not no_warmup)


def read_questions(file: str | None) -> list[str]:
    """-f: one question per non-empty line (llama-parallel would also keep empty lines as questions)."""
    if file is None:
        return QUESTIONS
    path = Path(file)
    if not path.is_file():
        raise BadInput(f"{file}: no such file")
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    lines = [ln for ln in lines if ln]
    if not lines:
        raise BadInput(f"{file}: no prompts (one per line)")
    return lines


def run(s: ParallelSettings) -> None:
    if s.list_devices:
        list_devices()
        return
    questions = read_questions(s.file)
    m = load_model(s.model, s.n_gpu_layers, threads=s.threads, numerics=s.numerics, split=s.split,
                   kv_types=(s.type_k, s.type_v), poll=s.poll)
    n_ctx = s.n_ctx or m.hp.n_ctx_train
    tok = m.tokenizer
    shared = s.system and s.shared_system
    system = tok.tokenize(SYSTEM_PROMPT, add_special=True, parse_special=False) if shared else []
    if len(system) >= n_ctx:
        raise BadInput(f"the system prompt is {len(system)} tokens, it does not fit the context (-c {n_ctx})")
    requests = make_requests(s.n_sequences, questions, s.n_junk, SYSTEM_PROMPT if s.system and not shared else "")
    # llama-parallel adds no BOS to a request: with a system prompt in it or shared, it comes after that
    jobs = [(r.question, tok.tokenize(r.text, add_special=not s.system, parse_special=False)) for r in requests]
    session = Session(m, SessionParams(n_ctx=n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                                       n_seq_max=s.n_parallel + 1, type_k=s.type_k, type_v=s.type_v,
                                       graph_reuse=s.graph_reuse, flash_attn=s.flash_attn))
    runner = ParallelRunner(session, s.n_parallel, s.n_predict, s.sampling, s.n_batch, s.ignore_eos,
                            stop_text=STOP_TEXT, cont_batching=s.cont_batching, chunk=s.prefill_chunk,
                            prefix_share=s.prefix_share)
    n_system = len(tok.tokenize(SYSTEM_PROMPT, add_special=True, parse_special=False)) if s.system else 0
    err_console.print(f"parallel: n_parallel = {s.n_parallel}, n_sequences = {s.n_sequences}, cont_batching = "
                      f"{int(s.cont_batching)}, system tokens = {n_system}", markup=False)
    with Interrupt() as stop:
        stop.watch(session)
        if s.warmup:
            runner.warm_up(len(system))
            runner.rehearse(system, jobs)
        summary = runner.run(system, jobs, lambda r: _print_result(r, s, runner.summary.cache_misses))
    if not s.json:
        err_console.print(f"External prompt file: {s.file or 'used built-in defaults'}\n"
                          f"Model and path used:  {m.path}", markup=False)
    _print_summary(summary, s.json)
    if summary.interrupted or stop.requested:
        raise Interrupted()


app.command("parallel")(command_from(settings, run))


def _print_result(r: SequenceResult, s: ParallelSettings, cache_misses: int) -> None:
    if r.stop_reason == STOP_CACHE:  # the one stop that is not the response's own end: said on stderr
        err_console.print(f"Client {r.client:3d}, seq {r.seq:3d}: stopped after {r.n_response} tokens, {STOP_CACHE} "
                          "(give -n or a larger -c)", markup=False)
    if s.json:
        rec = {"client": r.client, "seq": r.seq, "input": r.input, "response": r.response,
               "response_tokens": r.response_tokens, "n_prompt": r.n_prompt, "n_response": r.n_response,
               "seconds": r.seconds, "stop_reason": r.stop_reason}
        if r.skipped:
            rec["skipped"] = r.skipped
        print(json.dumps(rec), flush=True)
        return
    if r.skipped:
        print(f"Client {r.client:3d}, seq {r.seq:3d}/{s.n_sequences:3d}, skipped: {r.skipped}\n\n"
              f"Input:    {r.input.strip()}\n", flush=True)
        return
    speed = (r.n_prompt + r.n_response) / r.seconds if r.seconds else 0.0
    print(f"Client {r.client:3d}, seq {r.seq:3d}/{s.n_sequences:3d}, prompt {r.n_prompt:4d} t, response "
          f"{r.n_response:4d} t, time {r.seconds:5.2f} s, speed {speed:5.2f} t/s, cache miss {cache_misses}\n\n"
          f"Input:    {r.input.strip()}\nResponse: {r.response.strip()}\n", flush=True)


def _print_summary(s: ParallelSummary, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"prompt_tps": s.prompt_tps, "gen_tps": s.gen_tps, "total_tps": s.total_tps,
                          "cache_misses": s.cache_misses, "graphs_reused": s.graphs_reused,
                          "n_prompt": s.n_prompt, "n_prompt_shared": s.n_prompt_shared, "n_gen": s.n_gen, "n_system": s.n_system, "seconds": s.total_s,
                          "sequences_done": s.n_done, "sequences": s.n_sequences,
                          "interrupted": s.interrupted}), flush=True)
        return
    if s.interrupted:
        print(f"Interrupted after {s.n_done} of {s.n_sequences} sequences", flush=True)
    print(f"Total prompt tokens: {s.n_prompt:6d}, speed: {s.prompt_tps:5.2f} t/s\n"
          f"Total gen tokens:    {s.n_gen:6d}, speed: {s.gen_tps:5.2f} t/s\n"
          f"Total speed (AVG):   {'':6s}  speed: {s.total_tps:5.2f} t/s\n"
          f"Cache misses:        {s.cache_misses:6d}\n"
          f"Prompt tokens shared:{s.n_prompt_shared:6d}\n"
          f"Graphs reused:       {s.graphs_reused:6d}", flush=True)
