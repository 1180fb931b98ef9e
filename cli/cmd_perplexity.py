"""`ggrun perplexity`: score a text file like llama-perplexity; result on stdout. Ctrl-C prints the
estimate over the windows scored so far, then `interrupted`, exit 130."""
from __future__ import annotations

import json
import time

import typer

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.cmd_run import read_prompt
from ggrun.cli.common import check_positive, err_console, list_devices, load_model
from ggrun.cli.interrupt import Interrupt
from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.perplexity import score_tokens
from ggrun.core.llm.session import Session, SessionParams


@app.command("perplexity")
def perplexity_command(
    model: o.Model = None, file: o.File = None, ctx_size: o.Ctx = 2048, batch_size: o.BatchSize = 2048,
    ubatch_size: o.UBatchSize = 512, n_gpu_layers: o.GpuLayers = 0, threads: o.Threads = None,
    numerics: o.Numerics = "llama",
    output: str = typer.Option("text", "-o", "--output", help="text or json"), flash_attn: o.FlashAttn = True,
    list_devices_: o.ListDevices = False,
) -> None:
    """Perplexity of a text (like llama-perplexity)."""
    if list_devices_:
        list_devices()
        return
    if file is None:
        raise BadInput("give the text to score with -f FILE")
    if output not in ("text", "json"):
        raise BadInput(f"-o {output}: choose text or json")
    check_positive(**{"-c": ctx_size, "-b": batch_size, "-ub": ubatch_size})
    if ctx_size < 2:
        raise BadInput(f"-c {ctx_size}: a window needs at least 2 tokens")
    text = read_prompt(None, file)
    m = load_model(model, n_gpu_layers, threads=threads, numerics=numerics)
    tokens = m.tokenizer.tokenize(text, add_special=True, parse_special=False)
    if len(tokens) < 2:
        raise BadInput(f"{file}: too short to score ({len(tokens)} tokens)")
    session = Session(m, SessionParams(n_ctx=min(ctx_size, len(tokens)), n_batch=batch_size,
                                       n_ubatch=ubatch_size, flash_attn=flash_attn))
    t0 = time.perf_counter()
    with Interrupt() as stop:
        score = score_tokens(stop.watch(session), tokens, m.tokenizer.bos_id if m.tokenizer.add_bos else None)
    secs = time.perf_counter() - t0
    interrupted = score.interrupted or stop.requested
    so_far = f" (interrupted: {score.n_windows} of {score.n_windows_total} windows scored)" if interrupted else ""
    if output == "json":
        record = {"perplexity": score.perplexity if score.n_tokens else None, "n_tokens": score.n_tokens,
                  "n_ctx": session.n_ctx, "seconds": secs}
        if interrupted:
            record |= {"interrupted": True, "windows": score.n_windows, "windows_total": score.n_windows_total}
        typer.echo(json.dumps(record))
    elif score.n_tokens:
        typer.echo(f"perplexity: {score.perplexity:.4f} over {score.n_tokens} tokens{so_far}")
    else:
        typer.echo(f"perplexity: no estimate yet{so_far}")
    err_console.print(f"scored {score.n_tokens} tokens in {secs:.2f} s "
                      f"({score.n_tokens / secs:.1f} tokens per second)", markup=False)
    if interrupted:
        raise Interrupted()
