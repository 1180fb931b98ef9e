"""`ggrun run`: generate text from a prompt, like llama-cli, streaming tokens to stdout
and printing llama.cpp-style timings to stderr.

Every stop is said: a full context prints a notice (or, with --context-shift, old tokens are
discarded and generation goes on), and Ctrl-C ends the text with a newline, prints the timings so
far and `interrupted`, exit 130 (cli.interrupt). In --chat on a terminal, Ctrl-C ends the reply and
returns to the prompt."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.common import check_positive, err_console, list_devices, load_model, print_model_info, timing_line
from ggrun.cli.interrupt import Interrupt
from ggrun.core.errors import BadInput, Interrupted, RuntimeFailure
from ggrun.core.llm.generate import STOP_CONTEXT_FULL, STOP_INTERRUPTED, generate, keep_for_shift
from ggrun.core.llm.sampling import Sampler, SamplingParams
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.chat import render_chat
from ggrun.loaders.tokenizer import StreamDecoder

DEFAULT_PROMPT = "The three most useful things to know about the ocean are"


def read_prompt(prompt: str | None, file: str | None) -> str:
    if prompt is not None and file is not None:
        raise BadInput("give either -p or -f, not both")
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise BadInput(f"{file}: no such file")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise BadInput(f"{file}: not UTF-8 text") from None
    return DEFAULT_PROMPT if prompt is None else prompt


@app.command("run")
def run_command(
    model: o.Model = None, prompt: o.Prompt = None, file: o.File = None, n_predict: o.NPredict = 128,
    ctx_size: o.Ctx = 2048, batch_size: o.BatchSize = 2048, ubatch_size: o.UBatchSize = 512,
    n_gpu_layers: o.GpuLayers = 0, threads: o.Threads = None, numerics: o.Numerics = "llama",
    seed: o.Seed = -1, temp: o.Temp = 0.8, top_k: o.TopK = 40,
    top_p: o.TopP = 0.95, min_p: o.MinP = 0.05, repeat_penalty: o.RepeatPenalty = 1.0,
    repeat_last_n: o.RepeatLastN = 64,
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-generation tokens"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template (interactive when stdin is a terminal)"),
    verbose_prompt: bool = typer.Option(False, "--verbose-prompt", help="Print the prompt's tokens to stderr before generating"),
    list_devices_: o.ListDevices = False, no_graph_reuse: o.NoGraphReuse = False, flash_attn: o.FlashAttn = True,
    check_numerics: o.CheckNumerics = False, verbose: o.Verbose = False,
    context_shift: bool = typer.Option(False, "--context-shift/--no-context-shift", help="When the context is full, discard half of the tokens after the kept ones and go on (default: stop there, with a notice)"),
    n_keep: int = typer.Option(0, "--keep", help="Prompt tokens a context shift keeps at the start (-1: the whole prompt; BOS is always kept)"),
) -> None:
    """Generate text from a prompt (like llama-cli)."""
    if list_devices_:
        list_devices()
        return
    text = read_prompt(prompt, file)
    check_positive(**{"-c": ctx_size, "-b": batch_size, "-ub": ubatch_size})
    if n_predict < 0:
        raise BadInput(f"-n {n_predict}: the number of tokens to predict must not be negative")
    if n_keep < -1:
        raise BadInput(f"--keep {n_keep}: give a number of tokens, or -1 for the whole prompt")
    sampling = SamplingParams(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
    sampling.check()
    m = load_model(model, n_gpu_layers, threads=threads, numerics=numerics)
    session = Session(m, SessionParams(n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size,
                                       graph_reuse=not no_graph_reuse, flash_attn=flash_attn,
                                       check_numerics=check_numerics))
    if verbose:
        print_model_info(session)
    if chat and sys.stdin.isatty() and prompt is None and file is None:
        _interactive_chat(session, sampling, n_predict, ignore_eos)
        return
    if chat:
        text = _chat_prompt(m, [{"role": "user", "content": text}])
    _run_once(session, text, sampling, n_predict, ignore_eos, verbose_prompt, parse_special=chat,
              context_shift=context_shift, n_keep=n_keep)


def _chat_prompt(m, messages: list[dict]) -> str:
    tmpl = m.gguf.get("tokenizer.chat_template")
    if not tmpl:
        raise BadInput(f"{m.path}: the model has no chat template (tokenizer.chat_template)")
    tok = m.tokenizer
    bos = tok.token_to_piece(tok.bos_id).decode("utf-8", "replace") if tok.bos_id is not None else ""
    eos = tok.token_to_piece(tok.eos_id).decode("utf-8", "replace") if tok.eos_id is not None else ""
    return render_chat(tmpl, messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)


def _run_once(session: Session, text: str, sampling: SamplingParams, n_predict: int, ignore_eos: bool,
              verbose_prompt: bool, parse_special: bool, context_shift: bool = False, n_keep: int = 0) -> None:
    m = session.model
    tokens = m.tokenizer.tokenize(text, add_special=True, parse_special=parse_special)
    keep = keep_for_shift(n_keep, tokens, bool(tokens) and tokens[0] == m.tokenizer.bos_id and m.tokenizer.add_bos)
    if verbose_prompt:
        _print_prompt_tokens(m.tokenizer, tokens)
    dec = StreamDecoder(m.tokenizer)
    t0 = time.perf_counter()

    emitted: list[int] = []

    def emit(tid: int) -> None:
        emitted.append(tid)
        sys.stdout.write(dec.feed(tid))
        sys.stdout.flush()

    try:
        with Interrupt() as stop:
            out, st = generate(stop.watch(session), tokens, n_predict, Sampler(sampling, session.n_ctx), emit,
                               ignore_eos, context_shift, keep)
            interrupted = stop.requested or st.stop_reason == STOP_INTERRUPTED
    except RuntimeFailure:
        if emitted:  # the text so far gets its newline before the error line on stderr
            sys.stdout.write(dec.flush() + "\n")
            sys.stdout.flush()
        raise
    sys.stdout.write(dec.flush())
    if n_predict and (emitted or not interrupted):
        sys.stdout.write("\n")
    sys.stdout.flush()
    total_ms = 1e3 * (time.perf_counter() - t0)
    if st.stop_reason == STOP_CONTEXT_FULL:
        why = " (--keep leaves nothing to discard)" if context_shift else \
            "; --context-shift keeps going (discarding old tokens), or give a larger -c"
        print(f"ggrun: context full: generation stopped after {len(out)} tokens at the end of the context "
              f"(-c {session.n_ctx}){why}", file=sys.stderr)
    if st.n_shifts:
        print(f"ggrun: context shifted {st.n_shifts} time{'s' if st.n_shifts > 1 else ''}, "
              f"{st.n_discarded} tokens discarded (--keep {keep})", file=sys.stderr)
    _print_timings(session, st, total_ms, st.n_prompt + len(out))
    if interrupted:
        raise Interrupted()


def _print_prompt_tokens(tok, tokens: list[int]) -> None:
    err_console.print(f"prompt: {len(tokens)} tokens", markup=False)
    for t in tokens:
        piece = tok.token_to_piece(t).decode("utf-8", "replace")
        print(f"{t:6d} -> '{piece}'", file=sys.stderr)


def _print_timings(session: Session, st, total_ms: float, n_total: int) -> None:
    m = session.model
    lines = [
        f"{'load time':>17s} = {1e3 * m.load_seconds:10.2f} ms",
        timing_line("prompt eval time", 1e3 * st.prompt_s, st.n_prompt, "tokens"),
        timing_line("eval time", 1e3 * st.eval_s, st.n_eval, "runs"),
        f"{'total time':>17s} = {total_ms:10.2f} ms / {n_total:5d} tokens",
        f"{'graphs reused':>17s} = {session.stats.graphs_reused} (built {session.stats.graphs_built})",
    ]
    for line in lines:
        print(f"ggrun: {line}", file=sys.stderr)


def _interactive_chat(session: Session, sampling: SamplingParams, n_predict: int, ignore_eos: bool) -> None:
    """A multi-turn chat on a terminal: the whole conversation is re-rendered each turn."""
    messages: list[dict] = []
    sampler = Sampler(sampling, session.n_ctx)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        tokens = session.model.tokenizer.tokenize(_chat_prompt(session.model, messages), True, True)
        session.clear()
        dec = StreamDecoder(session.model.tokenizer)
        reply: list[str] = []

        def emit(tid: int) -> None:
            piece = dec.feed(tid)
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()

        with Interrupt() as stop:  # Ctrl-C ends this reply (kept as far as it got); the prompt comes back
            generate(stop.watch(session), tokens, n_predict, sampler, emit, ignore_eos)
        reply.append(dec.flush())
        sys.stdout.write(reply[-1] + "\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
