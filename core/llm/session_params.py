"""What a session is made with (llama.cpp's context parameters): context and batch sizes, sequences, KV cache
types, graph reuse and attention switches. A record of its own so the modules that set a session up (its
caches, its reservation) read it without importing the session."""
from __future__ import annotations

from dataclasses import dataclass

from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput


@dataclass(frozen=True)
class SessionParams:
    n_ctx: int = 2048
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    type_k: DType = DType.F16  # KV cache types (llama.cpp's -ctk / -ctv)
    type_v: DType = DType.F16
    graph_reuse: bool = True
    reuse_memory: bool = True  # False: every intermediate gets its own bytes (a reference run)
    flash_attn: bool = True  # fused attention op (llama.cpp's -fa, on by default as its "auto" on the CPU)
    check_numerics: bool = False  # on non-finite logits, find the node that made them (also GGRUN_GRAPH_DEBUG)
    n_copies: int | None = None  # pipeline slots; None: llama.cpp's rule (pipeline_copies)
    # KQ masks made where attention runs from the cells (inputs.KQMaskFromCells) instead of filled on the host;
    # None: when several sequences share a cache off the CPU, unless GGRUN_MASK_FROM_CELLS=0 (Session.mask_seq_words)
    mask_from_cells: bool | None = None

    def check(self) -> None:
        """Refuse sizes no session can have (BadInput: one line, exit code 2)."""
        if self.n_ctx < 1:
            raise BadInput(f"context size -c {self.n_ctx} must be positive")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise BadInput(f"batch sizes must be positive (-b {self.n_batch}, -ub {self.n_ubatch})")
        if self.n_seq_max < 1:
            raise BadInput(f"number of sequences {self.n_seq_max} must be positive")
