"""`ggrun serve`: llama-server's role, an OpenAI-compatible HTTP server over one batched engine loop.

Options are llama-server's: -m, --host (127.0.0.1: loopback unless told otherwise), --port (8080), -c,
-np (slots), -cb/-nocb, -ngl, -t, -fa, -ctk/-ctv, --api-key, --alias, --metrics, --slots/--no-slots,
--chat-template, -n. The HTTP server (uvicorn, in the main thread) answers at once: /health says 503
while a thread of its own loads the model, then runs the engine loop (core/llm/engine_loop.py) in that
same thread. Needs the optional extra `ggrun[serve]` (FastAPI, uvicorn, llguidance).

`--replicas N` serves the same routes from N engines on Ray Serve (cli/serve/cluster.py, the extra
`ggrun[cluster]`): a flag on the command a llama-server user already runs rather than a new command,
because nothing else about serving changes (the options, the routes and the bodies are the same).
"""
from __future__ import annotations

import sys
import threading
from typing import Optional

import typer

from ggrun.cli import options as o
from ggrun.cli.app import app
from ggrun.cli.cmdline import command_from
from ggrun.cli.common import err_console, list_devices
from ggrun.cli.serve.settings import ServeSettings
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput


def settings(
    model: o.Model = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: loopback only)"),
    port: int = typer.Option(8080, "--port", help="Port to listen on"),
    ctx_size: o.Ctx = 4096, batch_size: o.BatchSize = 2048, ubatch_size: o.UBatchSize = 512,
    n_parallel: int = typer.Option(4, "-np", "--parallel", help="Slots: requests decoded at once, each with "
                                                               "-c / -np of the context"),
    cont_batching: bool = typer.Option(True, "-cb/-nocb", "--cont-batching/--no-cont-batching",
                                       help="Continuous batching: a new request joins the batch as soon as a slot is "
                                            "free (-nocb: it waits until the batch in flight has finished)"),
    n_gpu_layers: o.GpuLayers = 0, threads: o.Threads = None, poll: o.Poll = None, numerics: o.Numerics = "llama",
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
    replicas: int = typer.Option(0, "--replicas", help="Serve from N engine replicas on Ray Serve behind one "
                                                       "ingress (each on a GPU of its own with -ngl, else on -t CPU "
                                                       "cores, default 1); needs the extra ggrun\\[cluster]. 0: one "
                                                       "engine here"),
    max_replicas: Optional[int] = typer.Option(None, "--max-replicas", help="With --replicas N: let Ray Serve's "
                                               "autoscaler run N..M replicas, aiming at -np requests in each"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --replicas: the Ray cluster to "
                                              "join ('auto': the one `ray start` made here; default: a new local one)"),
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
    if replicas < 0:
        raise BadInput(f"--replicas {replicas} must not be negative (0: one engine in this process)")
    if max_replicas is not None and (not replicas or max_replicas < replicas):
        raise BadInput(f"--max-replicas {max_replicas} needs --replicas N with N <= {max_replicas}")
    if ray_address and not replicas:
        raise BadInput("--ray-address needs --replicas N")
    o.check_poll(poll)
    return ServeSettings(
        model=model, host=host, port=port, n_ctx=ctx_size, n_parallel=n_parallel, n_batch=batch_size,
        n_ubatch=ubatch_size, cont_batching=cont_batching, n_gpu_layers=n_gpu_layers, threads=threads,
        poll=poll, numerics=numerics, flash_attn=flash_attn != "off" and not no_flash_attn, type_k=cache_type_k,
        type_v=cache_type_v, api_key=api_key or None, alias=alias, metrics=metrics, slots=slots,
        chat_template=chat_template, n_predict=n_predict, max_queue=max_queue, verbose=verbose, replicas=replicas,
        max_replicas=max_replicas or replicas, ray_address=ray_address)


def run(s: ServeSettings) -> None:
    """Start the HTTP server at once and load the model beside it; exit with the load's error if it fails.
    With --replicas, hand the settings to Ray Serve instead (cli/serve/cluster.py)."""
    if s.list_devices:
        list_devices()
        return
    if s.replicas:
        _run_cluster(s)
        return
    try:
        import uvicorn

        from ggrun.cli.serve.app import make_app
        from ggrun.cli.serve.engine import load_and_run, server_state
    except ImportError as err:
        raise BadInput(f"ggrun serve needs its extra: pip install 'ggrun[serve]' ({err})") from None
    state = server_state(s)
    server = uvicorn.Server(uvicorn.Config(make_app(state), host=s.host, port=s.port, log_level="info" if s.verbose
                                           else "warning", access_log=s.verbose, timeout_graceful_shutdown=2))
    failed: list[str] = []

    def on_loaded(error: str) -> None:
        """A load that failed stops the server with its one-line error."""
        if error:
            failed.append(error)
            server.should_exit = True

    engine_thread = threading.Thread(target=load_and_run, args=(s, state, on_loaded), name="ggrun-engine",
                                     daemon=True)
    engine_thread.start()
    err_console.print(f"ggrun serve: listening on http://{s.host}:{s.port} (loading the model)", markup=False)
    server.run()
    if state.engine is not None:
        state.engine.stop()
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr)
        sys.exit(2 if failed[0].startswith("bad input") else 1)


def _run_cluster(s: ServeSettings) -> None:
    """`ggrun serve --replicas N`: the same server as N engine replicas on Ray Serve (the extra ggrun[cluster])."""
    try:
        from ggrun.cli.serve.cluster import serve_replicas
    except ImportError as err:
        raise BadInput(f"ggrun serve --replicas needs its extra: pip install 'ggrun[cluster]' ({err})") from None
    serve_replicas(s)


app.command("serve")(command_from(settings, run))
