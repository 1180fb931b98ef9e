"""`ggrun serve --replicas N`: N ggrun engines on Ray Serve behind one OpenAI-compatible ingress (the extra
`ggrun[cluster]`, which is ray[serve]).

Two deployments. `EngineReplica` is one whole `ggrun serve`: it loads the model (cli/serve/engine.py), runs
its engine loop in a thread of its own and answers HTTP calls through the very FastAPI app `ggrun serve`
runs (cli/serve/app.py, called in-process by asgi_call.py), so the routes, the bodies, the key check and the
errors are the same by construction. Each replica asks Ray for a GPU of its own when layers are offloaded
(-ngl), else for -t CPU cores (ray_actor_options), so Ray places them on the cluster's nodes.

`Ingress` is what Ray Serve's HTTP proxy calls: it forwards each request to an engine replica through a
deployment handle (Ray Serve's request router: of two replicas picked at random, the one with fewer requests
in flight, each replica taking at most -np + --max-queue), relays the response as it comes (server-sent
events stay streamed) and tags it with the replica that served it (X-Ggrun-Replica). A replica that dies
before any byte of its response reached the client (a killed actor, a lost node) costs nothing: the ingress
sends the request again, to another replica, and Ray Serve's controller starts a new one in its place.
A stream that has begun is not retried (its client holds part of a reply); it ends where the replica died.

With --max-replicas M above N, Ray Serve's autoscaler runs N..M replicas, adding one when the requests in
flight per replica stay above -np (target_ongoing_requests) and removing one when they stay below.
"""
from __future__ import annotations

import asyncio
import signal
import threading
import time
from dataclasses import replace

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import RequestCancelledError
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ggrun.cli.common import err_console
from ggrun.cli.serve.app import make_app
from ggrun.cli.serve.asgi_call import HttpCall, ResponseStart, call_app
from ggrun.cli.serve.engine import load_and_run, server_state
from ggrun.cli.serve.errors import error_body
from ggrun.cli.serve.settings import ServeSettings
from ggrun.core.errors import BadInput, GGRunError, one_line

REPLICA_HEADER = "x-ggrun-replica"
RETRY_S = 60.0  # how long the ingress keeps sending a request whose replicas die before it is answered
DEAD = (RayActorError, ActorUnavailableError)  # a replica gone (killed, its node lost) or not reachable now
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}  # the proxy sets its own


class ReplicaLoadError(GGRunError):
    """A replica could not load the model (its one-line error)."""


class EngineReplica:
    """One `ggrun serve` (model, engine loop, FastAPI app) as a Ray Serve replica."""

    def __init__(self, s: ServeSettings) -> None:
        """Load the model on the engine's own thread and wait for it: Ray Serve routes to a replica only once
        its constructor has returned, so a replica is never asked while it loads."""
        self.state = server_state(s)
        self.app = make_app(self.state)
        loaded = threading.Event()
        errors: list[str] = []

        def on_loaded(error: str) -> None:
            """The load's outcome, from the engine's thread."""
            errors.append(error)
            loaded.set()

        self.thread = threading.Thread(target=load_and_run, args=(s, self.state, on_loaded), name="ggrun-engine",
                                       daemon=True)
        self.thread.start()
        loaded.wait()
        if errors[0]:
            raise ReplicaLoadError(errors[0])
        self.name = serve.get_replica_context().replica_id.unique_id

    async def forward(self, call: HttpCall):
        """The response to `call` from this replica's app: its ResponseStart (tagged with this replica's name),
        then its body chunks as they come."""
        async for part in call_app(self.app, call):
            if isinstance(part, ResponseStart):
                part = ResponseStart(part.status, part.headers + ((REPLICA_HEADER.encode(), self.name.encode()),))
            yield part

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop has ended is replaced."""
        if not self.thread.is_alive():
            raise RuntimeError("the engine loop has stopped")


class Ingress:
    """The one HTTP entry: each request forwarded to an engine replica, sent again while replicas die under it."""

    def __init__(self, engine) -> None:
        """engine: the DeploymentHandle of the EngineReplica deployment."""
        self.engine = engine.options(stream=True)

    async def __call__(self, request: HttpRequest) -> Response:
        """Forward the request; relay the response (streamed when it is server-sent events)."""
        call = HttpCall(request.method, request.url.path, request.url.query.encode(), tuple(request.headers.raw),
                        await request.body())
        opened = await self._open(call)
        if opened is None:
            return JSONResponse(error_body(503, "no engine replica could serve the request; try again later"),
                                status_code=503)
        start, chunks, rest = opened
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k.lower() not in HOP_HEADERS}
        if rest is None:
            return Response(b"".join(chunks), status_code=start.status, headers=headers)
        return StreamingResponse(_relay(chunks, rest), status_code=start.status, headers=headers)

    async def _open(self, call: HttpCall):
        """(start, chunks, rest) of the first replica that answers: a whole reply is read to its end (rest
        None), a stream to its first chunk (rest: the replica's iterator). A replica that dies before then
        means sending it again, to another one, for up to RETRY_S; None if none answered."""
        deadline = time.monotonic() + RETRY_S
        wait = 0.05
        while time.monotonic() < deadline:
            parts = self.engine.forward.remote(call)
            try:
                start = await parts.__anext__()
                streamed = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                               for k, v in start.headers)
                chunks = []
                async for chunk in parts:
                    chunks.append(chunk)
                    if streamed:
                        return start, chunks, parts
                return start, chunks, None
            except DEAD:
                parts.cancel()
            except asyncio.CancelledError:  # the client went away (Ray Serve cancels its call): free the slot
                parts.cancel()
                raise
            await asyncio.sleep(wait)
            wait = min(2 * wait, 1.0)
        return None


async def _relay(first: list[bytes], rest):
    """A stream's chunks: those read already, then the rest as the replica sends them; a replica that dies
    mid-stream ends it there. A client that goes away cancels the replica's call (its slot is freed)."""
    try:
        for chunk in first:
            yield chunk
        async for chunk in rest:
            yield chunk
    except (*DEAD, RequestCancelledError):
        return
    finally:
        rest.cancel()


def replica_options(s: ServeSettings) -> dict:
    """The engine deployment's options: a GPU per replica when layers are offloaded, else -t CPU cores (1 without
    -t: a replica's engine runs as many threads as it has cores, not every core of its node);
    a fixed replica count, or Ray Serve's autoscaling between --replicas and --max-replicas."""
    actor = {"num_gpus": 1, "num_cpus": 1} if s.n_gpu_layers else {"num_cpus": s.threads or 1}
    opts = {"name": "ggrun-engine", "ray_actor_options": actor, "max_ongoing_requests": s.n_parallel + s.max_queue,
            "max_constructor_retry_count": 2, "health_check_period_s": 5}
    if s.max_replicas > s.replicas:
        opts["autoscaling_config"] = {"min_replicas": s.replicas, "initial_replicas": s.replicas,
                                      "max_replicas": s.max_replicas, "target_ongoing_requests": s.n_parallel}
    else:
        opts["num_replicas"] = s.replicas
    return opts


def application(s: ServeSettings):
    """The Ray Serve application: the ingress bound to the engine deployment."""
    engine = serve.deployment(EngineReplica, **replica_options(s)).bind(replace(s, threads=s.threads or 1))
    most = max(s.replicas, s.max_replicas) * (s.n_parallel + s.max_queue)
    ingress = serve.deployment(Ingress, name="ggrun-ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=most)
    return ingress.bind(engine)


def start(s: ServeSettings, app_name: str = "ggrun") -> None:
    """Deploy the application on the Ray cluster this process is connected to, with Serve's HTTP proxy on
    --host:--port; returns once every replica has loaded its model. A replica that cannot load fails it."""
    serve.start(http_options={"host": s.host, "port": s.port})
    try:
        serve.run(application(s), name=app_name, route_prefix="/")
    except RuntimeError as err:
        status = serve.status().applications[app_name].deployments.get("ggrun-engine")
        why = _load_error(status.message if status else "") or one_line(str(err))
        if why.startswith("bad input: "):
            raise BadInput(why.removeprefix("bad input: ")) from None
        raise ReplicaLoadError(f"the replicas did not start: {why}") from None


def _load_error(message: str) -> str:
    """The one-line error a replica's constructor raised, from Ray Serve's account of the failed deployment
    (a traceback whose last ReplicaLoadError line is ours); "" when it holds none."""
    lines = [ln for ln in message.splitlines() if f"{ReplicaLoadError.__name__}: " in ln]
    return lines[-1].split(f"{ReplicaLoadError.__name__}: ", 1)[1] if lines else ""


def serve_replicas(s: ServeSettings) -> None:
    """`ggrun serve --replicas N`: join (or start) a Ray cluster, deploy, and serve until Ctrl-C or SIGTERM."""
    ray.init(address=s.ray_address, include_dashboard=False, logging_level="INFO" if s.verbose else "WARNING",
             log_to_driver=s.verbose)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        scale = f"{s.replicas}..{s.max_replicas}" if s.max_replicas > s.replicas else str(s.replicas)
        err_console.print(f"ggrun serve: starting {scale} replicas on Ray Serve", markup=False)
        start(s)
        err_console.print(f"ggrun serve: listening on http://{s.host}:{s.port} ({scale} replicas); ready",
                          markup=False)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
