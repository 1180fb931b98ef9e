"""`ggrun parallel`: many clients decoding at once over one model, one KV cache and one
batched graph per step (like llama-parallel). Ctrl-C prints the summary of the sequences finished so
far (each was printed when it finished), then `interrupted`, exit 130."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.common import check_positive, err_console, list_devices, load_model
from ggrun.cli.interrupt import Interrupt
from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.parallel import ParallelRunner, ParallelSummary, SequenceResult
from ggrun.core.llm.sampling import SamplingParams
from ggrun.core.llm.session import Session, SessionParams

SYSTEM_PROMPT = (
    "Transcript of a never ending dialog, where the User interacts with an Assistant.\n"
    "The Assistant is helpful, kind, honest, good at writing, and never fails to answer the User's "
    "requests immediately and with precision.\n\n"
    "User: Recommend a nice restaurant in the area.\n"
    "Assistant: I recommend the restaurant \"The Golden Duck\". It is a 5 star restaurant with a great view "
    "of the city. The food is delicious and the service is excellent.\n"
    "User: Who is the richest man in the world?\n"
    "Assistant: The richest people in the world change from year to year; business magazines publish "
    "their lists every spring.\n"
)

QUESTIONS = [
    "What is the meaning of life?",
    "Tell me an interesting fact about llamas.",
    "What is the best way to cook a steak?",
    "Are you familiar with the Special Theory of Relativity and can you explain it to me?",
    "Recommend some interesting books to read.",
    "What is the best way to learn a new language?",
    "How to get a job at Google?",
    "If you could have any superpower, what would it be?",
    "I want to learn how to play the piano.",
    "How do I keep houseplants alive in winter?",
    "What should I pack for a weekend hiking trip?",
    "Why is the sky blue?",
]


def format_prompt(question: str) -> str:
    return f"User: {question}\nAssistant:"


def read_questions(file: str | None) -> list[str]:
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


@app.command("parallel")
def parallel_command(
    model: o.Model = None,
    n_parallel: int = typer.Option(4, "-np", "--parallel", help="Concurrent clients"),
    n_sequences: int = typer.Option(16, "-ns", "--sequences", help="Sequences to serve in total"),
    n_predict: o.NPredict = 64, ctx_size: o.Ctx = 4096, batch_size: o.BatchSize = 512,
    ubatch_size: o.UBatchSize = 512, n_gpu_layers: o.GpuLayers = 0, threads: o.Threads = None,
    numerics: o.Numerics = "llama", file: o.File = None,
    seed: o.Seed = -1, temp: o.Temp = 0.8, top_k: o.TopK = 40, top_p: o.TopP = 0.95, min_p: o.MinP = 0.05,
    repeat_penalty: o.RepeatPenalty = 1.0, repeat_last_n: o.RepeatLastN = 64,
    no_system: bool = typer.Option(False, "--no-system-prompt", help="Serve the prompts without the shared system prompt"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate n tokens even past end-of-generation"),
    as_json: bool = typer.Option(False, "--json", help="JSON lines on stdout: one per sequence, then a summary"),
    list_devices_: o.ListDevices = False, no_graph_reuse: o.NoGraphReuse = False, flash_attn: o.FlashAttn = True,
) -> None:
    """Serve many sequences at once with continuous batching (like llama-parallel)."""
    if list_devices_:
        list_devices()
        return
    check_positive(**{"-np": n_parallel, "-ns": n_sequences, "-n": n_predict, "-c": ctx_size,
                      "-b": batch_size, "-ub": ubatch_size})
    sampling = SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
    sampling.check()
    questions = read_questions(file)
    m = load_model(model, n_gpu_layers, threads=threads, numerics=numerics)
    tok = m.tokenizer
    system = [] if no_system else tok.tokenize(SYSTEM_PROMPT, add_special=True, parse_special=False)
    if len(system) >= ctx_size:
        raise BadInput(f"the system prompt is {len(system)} tokens, it does not fit the context (-c {ctx_size})")
    jobs = []
    for i in range(n_sequences):
        q = questions[i % len(questions)]
        jobs.append((q, tok.tokenize(format_prompt(q), add_special=not system, parse_special=False)))
    session = Session(m, SessionParams(n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size,
                                       n_seq_max=n_parallel + 1, graph_reuse=not no_graph_reuse,
                                       flash_attn=flash_attn))
    runner = ParallelRunner(session, n_parallel, n_predict, sampling, batch_size, ignore_eos)
    err_console.print(f"serving {n_sequences} sequences with {n_parallel} clients; system prompt "
                      f"{len(system)} tokens", markup=False)
    with Interrupt() as stop:
        stop.watch(session)
        summary = runner.run(system, jobs, lambda r: _print_result(r, as_json))
    _print_summary(summary, as_json)
    if summary.interrupted or stop.requested:
        raise Interrupted()


def _print_result(r: SequenceResult, as_json: bool) -> None:
    if as_json:
        rec = {"client": r.client, "seq": r.seq, "input": r.input, "response": r.response,
               "response_tokens": r.response_tokens, "n_prompt": r.n_prompt, "n_response": r.n_response,
               "seconds": r.seconds}
        if r.skipped:
            rec["skipped"] = r.skipped
        print(json.dumps(rec), flush=True)
        return
    if r.skipped:
        print(f"Client {r.client:3d}, seq {r.seq:4d}: skipped: {r.skipped}\nInput:    {r.input}\n", flush=True)
        return
    speed = r.n_response / r.seconds if r.seconds else 0.0
    print(f"Client {r.client:3d}, seq {r.seq:4d}, prompt {r.n_prompt:4d} t, response {r.n_response:4d} t, "
          f"time {r.seconds:5.2f} s, speed {speed:6.2f} t/s\n"
          f"Input:    {r.input}\nResponse: {r.response.strip()}\n", flush=True)


def _print_summary(s: ParallelSummary, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"prompt_tps": s.prompt_tps, "gen_tps": s.gen_tps, "total_tps": s.total_tps,
                          "cache_misses": s.cache_misses, "graphs_reused": s.graphs_reused,
                          "n_prompt": s.n_prompt, "n_gen": s.n_gen, "seconds": s.total_s,
                          "sequences_done": s.n_done, "sequences": s.n_sequences,
                          "interrupted": s.interrupted}), flush=True)
        return
    if s.interrupted:
        print(f"Interrupted after {s.n_done} of {s.n_sequences} sequences", flush=True)
    print(f"Total prompt tokens: {s.n_prompt:6d}, speed: {s.prompt_tps:7.2f} t/s\n"
          f"Total gen tokens:    {s.n_gen:6d}, speed: {s.gen_tps:7.2f} t/s\n"
          f"Total speed (AVG):           speed: {s.total_tps:7.2f} t/s\n"
          f"Cache misses:        {s.cache_misses:6d}\n"
          f"Graphs reused:       {s.graphs_reused:6d}", flush=True)
    sys.stdout.flush()
