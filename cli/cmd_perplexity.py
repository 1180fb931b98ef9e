"""`ggrun perplexity`: llama-perplexity's method, options and output (cli/perplexity_report.py).

Results go to stdout as llama-perplexity writes them (`[1]x,[2]y,...` as each chunk is scored, then
`Final estimate: PPL = X +/- Y`), its log lines to stderr. `--kl-divergence-base FILE` also saves the
run's log-probabilities in llama.cpp's file format; with `--kl-divergence` the text and the context
come from that file and this model is compared with the one that wrote it.

llama-perplexity packs n_batch / n_ctx chunks into one batch as separate sequences; ggrun evaluates
the chunks one after the other, which scores the same tokens over the same context. Ctrl-C prints the
estimate over the chunks scored so far, then `interrupted`, exit 130.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Optional

import typer

from ggrun.cli import options as o
from ggrun.cli import perplexity_report as report
from ggrun.cli.app import app
from ggrun.cli.cmd_run import read_prompt
from ggrun.cli.cmdline import command_from
from ggrun.cli.common import check_positive, err_console, list_devices, load_model
from ggrun.cli.interrupt import Interrupt
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.placement import DeviceSplit
from ggrun.core.llm.kl_divergence import KLStats, LogProbReader, LogProbWriter
from ggrun.core.llm.perplexity import ChunkPlan, Estimate, evaluate_chunks, plan_chunks, token_nll
from ggrun.core.llm.session import Session, SessionParams


@dataclass(frozen=True)
class PerplexitySettings:
    """What a `ggrun perplexity` command line asks for."""

    model: str | None = None
    file: str | None = None
    n_ctx: int = 512
    n_batch: int = 2048
    n_ubatch: int = 512
    n_chunks: int = -1  # -1: every chunk the text holds
    n_gpu_layers: int = 0
    split: DeviceSplit = DeviceSplit()  # -dev, -sm, -ts, -mg
    threads: int | None = None
    poll: int | None = None  # --poll: None, the default level
    numerics: str = "llama"
    flash_attn: bool = True
    type_k: DType = DType.F16
    type_v: DType = DType.F16
    output: str = "text"
    kl_divergence_base: str | None = None  # the log-probability file: written, or read with kl_divergence
    kl_divergence: bool = False
    check_tensors: bool = False
    list_devices: bool = False

    @property
    def saves_base(self) -> bool:
        return self.kl_divergence_base is not None and not self.kl_divergence


def settings(
    model: o.Model = None, file: o.File = None, ctx_size: o.Ctx = 512, batch_size: o.BatchSize = 2048,
    ubatch_size: o.UBatchSize = 512,
    chunks: int = typer.Option(-1, "--chunks", help="Score at most this many chunks of -c tokens (-1: all)"),
    n_gpu_layers: o.GpuLayers = 0, device: o.Devices = None, split_mode: o.SplitMode = "layer",
    tensor_split: o.TensorSplit = None, main_gpu: o.MainGpu = 0, threads: o.Threads = None,
    poll: o.Poll = None, numerics: o.Numerics = "llama", flash_attn: o.FlashAttnMode = "auto", no_flash_attn: o.NoFlashAttn = False,
    cache_type_k: o.CacheTypeK = DType.F16, cache_type_v: o.CacheTypeV = DType.F16,
    output: str = typer.Option("text", "-o", "--output", help="text (llama-perplexity's lines) or json"),
    kl_divergence_base: Optional[str] = typer.Option(
        None, "--kl-divergence-base", "--save-all-logits",
        help="Save this run's log-probabilities to FILE (llama.cpp's format); with --kl-divergence, read them"),
    kl_divergence: bool = typer.Option(
        False, "--kl-divergence", help="Compare with the run saved in --kl-divergence-base (text and -c come from it)"),
    check_tensors: o.CheckTensors = False, list_devices_: o.ListDevices = False,
) -> PerplexitySettings:
    """Perplexity of a text, scored as llama-perplexity scores it (chunks of -c tokens, second halves)."""
    o.check_poll(poll)
    s = PerplexitySettings(
        model=model, file=file, n_ctx=ctx_size, n_batch=batch_size, n_ubatch=ubatch_size, n_chunks=chunks,
        n_gpu_layers=n_gpu_layers, split=o.device_split(device, split_mode, tensor_split, main_gpu), threads=threads,
        poll=poll, numerics=numerics,
        flash_attn=flash_attn != "off" and not no_flash_attn, type_k=cache_type_k, type_v=cache_type_v,
        output=output, kl_divergence_base=kl_divergence_base, kl_divergence=kl_divergence,
        check_tensors=check_tensors,
        list_devices=list_devices_)
    if list_devices_:
        return s
    if output not in ("text", "json"):
        raise BadInput(f"-o {output}: choose text or json")
    check_positive(**{"-c": ctx_size, "-b": batch_size, "-ub": ubatch_size})
    if chunks == 0 or chunks < -1:
        raise BadInput(f"--chunks {chunks}: give a positive number of chunks, or -1 for all")
    if kl_divergence and kl_divergence_base is None:
        raise BadInput("--kl-divergence needs --kl-divergence-base FILE (the base model's saved log-probabilities)")
    if file is None and not kl_divergence:
        raise BadInput("give the text to score with -f FILE")
    return s


def run(s: PerplexitySettings) -> None:
    if s.list_devices:
        list_devices()
        return
    if s.kl_divergence:
        _run_kl_divergence(s)
    else:
        _run_perplexity(s)


app.command("perplexity")(command_from(settings, run))


def _read_text(file: str) -> str:
    """The text of -f as llama.cpp reads it: one trailing newline dropped."""
    text = read_prompt(None, file)
    return text[:-1] if text.endswith("\n") else text


def _session(m, s: PerplexitySettings, n_ctx: int) -> Session:
    n_batch = min(s.n_batch, n_ctx)
    return Session(m, SessionParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(s.n_ubatch, n_batch),
                                    type_k=s.type_k, type_v=s.type_v, flash_attn=s.flash_attn))


def _bos(m) -> int | None:
    return m.tokenizer.bos_id if m.tokenizer.add_bos else None


def _announce(plan: ChunkPlan, s: PerplexitySettings, what: str = "calculating perplexity") -> None:
    err_console.print(f"perplexity: {what} over {plan.n_chunks} chunks, n_ctx={plan.n_ctx}, "
                      f"batch_size={min(s.n_batch, plan.n_ctx)}, n_seq=1", markup=False)


def _eta(i: int, plan: ChunkPlan, t0: float) -> None:
    """llama.cpp's line after the first chunk: seconds per pass and the time left."""
    if i == 0:
        per = time.perf_counter() - t0
        err_console.print(f"perplexity: {per:.2f} seconds per pass - ETA {per * plan.n_chunks / 60:.2f} minutes",
                          markup=False)


def _run_perplexity(s: PerplexitySettings) -> None:
    text = _read_text(s.file)
    m = load_model(s.model, s.n_gpu_layers, threads=s.threads, numerics=s.numerics, split=s.split,
                   check_tensors=s.check_tensors, kv_types=(s.type_k, s.type_v), poll=s.poll)
    tokens = m.tokenizer.tokenize(text, add_special=True, parse_special=False)
    plan = plan_chunks(len(tokens), s.n_ctx, s.n_chunks)
    session = _session(m, s, plan.n_ctx)
    writer = LogProbWriter(s.kl_divergence_base, plan.n_ctx, m.hp.n_vocab, plan.n_chunks, tokens) \
        if s.saves_base else None
    if writer is not None:
        err_console.print(f"perplexity: saving all logits to {s.kl_divergence_base}", markup=False)
    _announce(plan, s)
    est = Estimate()
    text_out = s.output == "text"
    t0 = time.perf_counter()
    with Interrupt() as stop:
        try:
            for chunk in evaluate_chunks(stop.watch(session), tokens, plan, s.n_batch, _bos(m)):
                _eta(chunk.index, plan, t0)
                est.add(token_nll(chunk.logits, chunk.targets))
                if writer is not None:
                    writer.write(chunk.logits)
                if text_out:
                    sys.stdout.write(report.running_entry(chunk.index + 1, est.perplexity))
                    sys.stdout.flush()
        except Interrupted:
            pass
        finally:
            if writer is not None:
                writer.close()
    secs = time.perf_counter() - t0
    interrupted = stop.requested or len(est.running) < plan.n_chunks
    if text_out:
        sys.stdout.write("\n")
        if est.count:
            typer.echo(report.final_estimate(est))
    else:
        unc = est.uncertainty
        record = {"perplexity": est.perplexity if est.count else None,
                  "uncertainty": None if math.isnan(unc) else unc,
                  "n_ctx": plan.n_ctx, "n_chunks": len(est.running), "n_tokens": est.count, "chunks": est.running,
                  "seconds": secs}
        if interrupted:
            record |= {"interrupted": True, "chunks_total": plan.n_chunks}
        typer.echo(json.dumps(record))
    so_far = f" (interrupted after {len(est.running)} of {plan.n_chunks} chunks)" if interrupted else ""
    err_console.print(f"perplexity: scored {est.count} tokens in {secs:.2f} s"
                      f" ({est.count / secs if secs else 0:.1f} tokens per second){so_far}", markup=False)
    if interrupted:
        raise Interrupted()


def _run_kl_divergence(s: PerplexitySettings) -> None:
    base = LogProbReader(s.kl_divergence_base)
    m = load_model(s.model, s.n_gpu_layers, threads=s.threads, numerics=s.numerics, split=s.split,
                   check_tensors=s.check_tensors, kv_types=(s.type_k, s.type_v), poll=s.poll)
    if base.n_vocab != m.hp.n_vocab:
        raise BadInput(f"{s.kl_divergence_base}: inconsistent vocabulary ({base.n_vocab} in the file, "
                       f"{m.hp.n_vocab} in the model)")
    plan = ChunkPlan(base.n_ctx, base.n_chunks)
    session = _session(m, s, plan.n_ctx)
    _announce(plan, s, "computing")
    stats = KLStats()
    text_out = s.output == "text"
    t0 = time.perf_counter()
    with Interrupt() as stop:
        try:
            for chunk in evaluate_chunks(stop.watch(session), base.tokens, plan, s.n_batch, _bos(m)):
                _eta(chunk.index, plan, t0)
                if chunk.index == 0 and text_out:
                    typer.echo("\n" + report.KLD_HEADER)
                stats.add(chunk.logits, chunk.targets, base.chunk(chunk.index))
                if text_out:
                    typer.echo(report.kld_row(chunk.index + 1, stats))
        except Interrupted:
            pass
        finally:
            base.close()
    interrupted = stop.requested or stats.count < plan.n_chunks * plan.n_scored
    if text_out:
        typer.echo("")
        for line in report.kld_summary(stats):
            typer.echo(line)
    else:
        typer.echo(json.dumps(report.kld_record(stats) | {"n_ctx": plan.n_ctx, "interrupted": interrupted}))
    if interrupted:
        raise Interrupted()
