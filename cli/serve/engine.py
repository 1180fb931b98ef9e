"""The engine a `ggrun serve` command line makes: the model loaded, its session, chat template and EngineLoop,
put into the routes' ServerState. One place for it, because two hosts run it: `ggrun serve`'s own engine
thread (cli/cmd_serve.py) and each Ray Serve replica (cli/serve/cluster.py).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from ggrun.cli.cmd_run import chat_template
from ggrun.cli.common import err_console, load_model
from ggrun.cli.serve.app import ServerState
from ggrun.cli.serve.settings import ServeSettings
from ggrun.core.errors import BadInput, GGRunError, one_line
from ggrun.core.llm.engine_loop import EngineLoop
from ggrun.core.llm.session import Session, SessionParams


SWITCH_INTERVAL = 0.0005  # seconds a thread may hold the GIL while another waits (Python's default: 0.005)


def share_the_gil() -> None:
    """Let the engine thread and the HTTP thread hand the GIL to each other every half millisecond instead of
    every 5 ms: each token passes from one to the other, and the default interval made a token wait for it.
    One request streaming llama-135m Q4_0 on this 2-core AMD EPYC (-t 1): 145 -> 172 tokens/s (ggrun bench's
    tg: 206); a process-wide setting, made where a process starts to host an engine beside its routes."""
    sys.setswitchinterval(SWITCH_INTERVAL)


def server_state(s: ServeSettings) -> ServerState:
    """The routes' shared state for these settings, before the model is loaded."""
    return ServerState(alias=s.alias or Path(s.model or "SmolLM2-135M-Instruct").stem, api_key=s.api_key,
                       metrics=s.metrics, slots=s.slots, n_predict=s.n_predict)


def load_engine(s: ServeSettings, state: ServerState) -> EngineLoop:
    """Load the model, make the session, template and engine, and hand them to `state` (the routes answer
    from then on). Raises the load's GGRunError. Call it on the thread that will run the engine: the numba
    kernels' thread count is set per thread."""
    share_the_gil()
    m = load_model(s.model, s.n_gpu_layers, threads=s.threads, numerics=s.numerics, kv_types=(s.type_k, s.type_v),
                   quiet=True, poll=s.poll)
    n_ctx = s.n_ctx or m.hp.n_ctx_train
    session = Session(m, SessionParams(n_ctx=n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch, n_seq_max=s.n_parallel,
                                       type_k=s.type_k, type_v=s.type_v, flash_attn=s.flash_attn))
    template = chat_template(m, s.chat_template)
    engine = EngineLoop(session, s.n_parallel, s.n_batch, s.max_queue, s.cont_batching)
    state.model_path = str(m.path)
    state.template = template
    state.template_source = template.source if template is not None else ""
    state.body_limit = max(1 << 20, 64 * n_ctx)
    state.engine = engine
    err_console.print(f"ggrun serve: model loaded ({m.path.name}, {s.n_parallel} slots of {engine.slot_ctx} tokens"
                      f"{'' if s.cont_batching else ', no continuous batching'}); ready", markup=False)
    return engine


def load_and_run(s: ServeSettings, state: ServerState, on_loaded: Callable[[str], None]) -> None:
    """Load the engine on this thread, then run its loop here until it is stopped. on_loaded("") once the
    routes answer, or on_loaded(the load's one-line error, "bad input: ..." for BadInput) when it fails."""
    try:
        engine = load_engine(s, state)
    except GGRunError as err:
        on_loaded(("bad input: " if isinstance(err, BadInput) else "") + one_line(str(err)))
        return
    on_loaded("")
    engine.run()
