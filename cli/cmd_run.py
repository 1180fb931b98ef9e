"""`ggrun run`: generate text or chat, like llama-completion and llama-cli. The options and what they
mean live in cli/run_settings.py; the turn loop (echo, streaming, conversation) in cli/conversation.py.

With a model that has a chat template, and no -no-cnv, the run is a conversation (as in llama.cpp);
without one it continues the prompt. Text goes to stdout; the seed, notices and llama.cpp's timing
block go to stderr. Every stop is said: a full context prints a notice (or, with --context-shift, old
tokens are discarded and generation goes on), and Ctrl-C outside a conversation's reply ends the text
with a newline, prints the timings so far and `interrupted`, exit 130 (cli.interrupt).
"""
from __future__ import annotations

import sys
import time

from ggrun.cli.app import app
from ggrun.cli.cmdline import command_from
from ggrun.cli.common import err_console, list_devices, load_model, print_model_info, timing_line
from ggrun.cli.conversation import Conversation
from ggrun.cli.run_settings import RunSettings, read_text, run_settings
from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.generate import GenerationStats
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.chat import ChatTemplate


def read_prompt(prompt: str | None, file: str | None) -> str:
    """-p's text, or the text of the file -f names (BadInput naming a missing or non-UTF-8 file)."""
    if prompt is not None and file is not None:
        raise BadInput("give either -p or -f, not both")
    return read_text(file) if file is not None else prompt or ""


def run(s: RunSettings) -> None:
    """Load the model, open a session of the model's training context (-c 0, the default) or -c, and
    run the conversation; the timing block is printed at the end, also after Ctrl-C."""
    if s.list_devices:
        list_devices()
        return
    prompt, system, template_source = s.prompt_text(), s.system_prompt_text(), s.chat_template_source()
    m = load_model(s.model, s.n_gpu_layers, threads=s.threads, numerics=s.numerics, split=s.split,
                   check_tensors=s.check_tensors, kv_types=(s.type_k, s.type_v), poll=s.poll)
    session = Session(m, SessionParams(n_ctx=s.n_ctx or m.hp.n_ctx_train, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                                       type_k=s.type_k, type_v=s.type_v, graph_reuse=s.graph_reuse,
                                       flash_attn=s.flash_attn, check_numerics=s.check_numerics))
    if s.verbose:
        print_model_info(session)
    template = chat_template(m, template_source)
    conversation = s.conversation if s.conversation is not None else template is not None
    if s.conversation is None and conversation:
        err_console.print("ggrun: chat template is available, enabling conversation mode (disable it with -no-cnv)",
                          markup=False)
    if conversation and template is None and s.use_chat_template:
        err_console.print("ggrun: the model has no chat template; conversation mode uses chatml", markup=False)
        template = chat_template(m, "chatml")
    talk = Conversation(session, s, template, conversation)
    t0 = time.perf_counter()
    try:
        talk.run(prompt, system)
    except Interrupted:
        print_timings(session, talk.gen.totals, 1e3 * (time.perf_counter() - t0))
        raise
    print_timings(session, talk.gen.totals, 1e3 * (time.perf_counter() - t0))


app.command("run")(command_from(run_settings, run))


def chat_template(m: Model, source: str | None) -> ChatTemplate | None:
    """The chat template to use: `source` (a built-in name or Jinja) or the model's, with the model's BOS
    and EOS texts; None when neither exists."""
    source = source or m.gguf.get("tokenizer.chat_template")
    if not source:
        return None
    tok = m.tokenizer
    bos = tok.token_to_piece(tok.bos_id).decode("utf-8", "replace") if tok.bos_id is not None else ""
    eos = tok.token_to_piece(tok.eos_id).decode("utf-8", "replace") if tok.eos_id is not None else ""
    return ChatTemplate.named(source, bos_token=bos, eos_token=eos, strip_bos=tok.add_bos, strip_eos=tok.add_eos)


def print_timings(session: Session, t: GenerationStats, total_ms: float) -> None:
    """llama.cpp's perf block (common_perf_print) on stderr: sampling, load, prompt eval, eval, total,
    unaccounted time, and graph reuse."""
    sampling_ms, prompt_ms, eval_ms = 1e3 * t.sample_s, 1e3 * t.prompt_s, 1e3 * t.eval_s
    unaccounted = total_ms - sampling_ms - prompt_ms - eval_ms
    share = 100.0 * unaccounted / total_ms if total_ms > 0 else 0.0
    stats = session.stats
    lines = [
        f"{'sampling time':>17s} = {sampling_ms:10.2f} ms / {t.n_sampled:5d} tokens",
        f"{'load time':>17s} = {1e3 * session.model.load_seconds:10.2f} ms",
        timing_line("prompt eval time", prompt_ms, t.n_prompt, "tokens"),
        timing_line("eval time", eval_ms, t.n_eval, "runs"),
        f"{'total time':>17s} = {total_ms:10.2f} ms / {t.n_prompt + t.n_eval:5d} tokens",
        f"{'unaccounted time':>17s} = {unaccounted:10.2f} ms / {share:5.1f} %      "
        "(total - sampling - prompt eval - eval) / (total)",
        f"{'graphs reused':>17s} = {stats.graphs_reused:10d} (built {stats.graphs_built})",
    ]
    sys.stdout.flush()
    for line in lines:
        print(f"ggrun: {line}", file=sys.stderr)
