"""`ggrun serve`: llama-server's role, an OpenAI-compatible HTTP server over one batched engine loop.

Options are llama-server's: -m, --host (127.0.0.1: loopback unless told otherwise), --port (8080), -c,
-np (slots), -cb, -ngl, -t, -fa, -ctk/-ctv, --api-key, --alias, --metrics, --slots/--no-slots,
--chat-template, -n. The HTTP server (uvicorn, in the main thread) answers at once: /health says 503
while a thread of its own loads the model, then runs the engine loop (core/llm/engine_loop.py) in that
same thread. Needs the optional extra `ggrun[serve]` (FastAPI, uvicorn, llguidance).
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.cmdline import command_from
from ggrun.cli.common import err_console, list_devices, load_model
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput, GGRunError, one_line


@dataclass(frozen=True)
class ServeSettings:
    """What a `ggrun serve` command line asks for (llama-server's defaults where ggrun has them)."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    n_ctx: int = 4096
    n_parallel: int = 4
    n_batch: int = 2048
    n_ubatch: int = 512
    cont_batching: bool = True
    n_gpu_layers: int = 0
    threads: int | None = None
    numerics: str = "llama"
    flash_attn: bool = True
    type_k: DType = DType.F16
    type_v: DType = DType.F16
    api_key: str | None = None
    alias: str | None = None
    metrics: bool = False
    slots: bool = True
    chat_template: str | None = None
    n_predict: int = -1
    max_queue: int = 64
    verbose: bool = False
    list_devices: bool = False


def settings(
    model: o.Model = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: loopback only)"),
    port: int = typer.Option(8080, "--port", help="Port to listen on"),
    ctx_size: o.Ctx = 4096, batch_size: o.BatchSize = 2048, ubatch_size: o.UBatchSize = 512,
    n_parallel: int = typer.Option(4, "-np", "--parallel", help="Slots: requests decoded at once, each with "
                                                               "-c / -np of the context"),
    cont_batching: bool = typer.Option(True, "-cb/-nocb", "--cont-batching/--no-cont-batching",
                                       help="Accepted for llama-server's command lines: requests always join the "
                                            "batch as soon as a slot is free"),
    n_gpu_layers: o.GpuLayers = 0, threads: o.Threads = None, numerics: o.Numerics = "llama",
    flash_attn: o.FlashAttnMode = "auto", no_flash_attn: o.NoFlashAttn = False,
    cache_type_k: o.CacheTypeK = DType.F16, cache_type_v: o.CacheTypeV = DType.F16,
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require this key (Bearer token or X-Api-Key) "
                                                                  "on every route but /health"),
    alias: Optional[str] = typer.Option(None, "-a", "--alias", help="Model name the API reports (default: the file's)"),
    metrics: bool = typer.Option(False, "--metrics", help="Serve Prometheus metrics at /metrics"),
    slots: bool = typer.Option(True, "--slots/--no-slots", help="Serve the slots' state at /slots (default: on)"),
    chat_template: o.ChatTemplate = None,
    n_predict: int = typer.Option(-1, "-n", "--n-predict", "--predict",
                                  help="Most tokens per request (-1: until the slot's context is full)"),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for a slot; more get 503"),
    verbose: o.Verbose = False, list_devices_: o.ListDevices = False,
) -> ServeSettings:
    """Serve a model over llama-server's OpenAI-compatible HTTP API (like llama-server)."""
    if list_devices_:
        return ServeSettings(list_devices=True)
    for flag, v in (("-np", n_parallel), ("-b", batch_size), ("-ub", ubatch_size), ("--max-queue", max_queue)):
        if v < 1:
            raise BadInput(f"{flag} {v} must be positive")
    if not 0 <= port <= 65535:
        raise BadInput(f"--port {port} must lie in 0..65535")
    if ctx_size < 0:
        raise BadInput(f"-c {ctx_size} must not be negative (0: the model's training context)")
    if n_predict < -1:
        raise BadInput(f"-n {n_predict}: give a number of tokens, or -1 for no limit")
    return ServeSettings(
        model=model, host=host, port=port, n_ctx=ctx_size, n_parallel=n_parallel, n_batch=batch_size,
        n_ubatch=ubatch_size, cont_batching=cont_batching, n_gpu_layers=n_gpu_layers, threads=threads,
        numerics=numerics, flash_attn=flash_attn != "off" and not no_flash_attn, type_k=cache_type_k,
        type_v=cache_type_v, api_key=api_key or None, alias=alias, metrics=metrics, slots=slots,
        chat_template=chat_template, n_predict=n_predict, max_queue=max_queue, verbose=verbose)


def run(s: ServeSettings) -> None:
    """Start the HTTP server at once and load the model beside it; exit with the load's error if it fails."""
    if s.list_devices:
        list_devices()
        return
    try:
        import uvicorn

        from ggrun.cli.serve.app import ServerState, make_app
    except ImportError as err:
        raise BadInput(f"ggrun serve needs its extra: pip install 'ggrun[serve]' ({err})") from None
    state = ServerState(alias=s.alias or Path(s.model or "SmolLM2-135M-Instruct").stem, api_key=s.api_key,
                        metrics=s.metrics, slots=s.slots, n_predict=s.n_predict)
    server = uvicorn.Server(uvicorn.Config(make_app(state), host=s.host, port=s.port, log_level="info" if s.verbose
                                           else "warning", access_log=s.verbose, timeout_graceful_shutdown=2))
    failed: list[str] = []
    engine_thread = threading.Thread(target=_load_and_serve, args=(s, state, server, failed), name="ggrun-engine",
                                     daemon=True)
    engine_thread.start()
    err_console.print(f"ggrun serve: listening on http://{s.host}:{s.port} (loading the model)", markup=False)
    server.run()
    if state.engine is not None:
        state.engine.stop()
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr)
        sys.exit(2 if failed[0].startswith("bad input") else 1)


def _load_and_serve(s: ServeSettings, state, server, failed: list[str]) -> None:
    """Load the model, make the session and the engine, and run the engine loop in this thread; a load
    that fails stops the server with its one-line error."""
    from ggrun.cli.cmd_run import chat_template
    from ggrun.core.llm.engine_loop import EngineLoop
    from ggrun.core.llm.session import Session, SessionParams

    try:
        m = load_model(s.model, s.n_gpu_layers, threads=s.threads, numerics=s.numerics,
                       kv_types=(s.type_k, s.type_v), quiet=True)
        n_ctx = s.n_ctx or m.hp.n_ctx_train
        session = Session(m, SessionParams(n_ctx=n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                                           n_seq_max=s.n_parallel, type_k=s.type_k, type_v=s.type_v,
                                           flash_attn=s.flash_attn))
        template = chat_template(m, s.chat_template)
        engine = EngineLoop(session, s.n_parallel, s.n_batch, s.max_queue)
    except GGRunError as err:
        failed.append(("bad input: " if isinstance(err, BadInput) else "") + one_line(str(err)))
        server.should_exit = True
        return
    state.model_path = str(m.path)
    state.template = template
    state.template_source = template.source if template is not None else ""
    state.body_limit = max(1 << 20, 64 * n_ctx)
    state.engine = engine
    err_console.print(f"ggrun serve: model loaded ({m.path.name}, {s.n_parallel} slots of {engine.slot_ctx} tokens); "
                      f"ready", markup=False)
    engine.run()


app.command("serve")(command_from(settings, run))
