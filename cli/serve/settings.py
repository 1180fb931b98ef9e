"""What a `ggrun serve` command line asks for: a record with no imports beyond the dtype, so the command's
options parse without FastAPI or the engine (cli/serve/engine.py makes the engine from it)."""
from __future__ import annotations

from dataclasses import dataclass

from ggrun.core.dtypes import DType


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
    poll: int | None = None  # --poll: None, the default level
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
    replicas: int = 0  # 0: one engine in this process; else Ray Serve replicas (cli/serve/cluster.py)
    max_replicas: int = 0  # above `replicas`: Ray Serve's autoscaler may add replicas up to this many
    ray_address: str | None = None  # a running Ray cluster ("auto", "ray://head:10001"); None: a local one
