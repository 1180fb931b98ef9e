#!/usr/bin/env python3
"""Graph nodes per layer of each architecture, on tiny synthetic models (loaders/synthetic.py): the
difference between the graphs of models with n and n + 1 layers, so nothing outside the layers
counts. Compute nodes (kernel calls) and all nodes (views too), for a decode step and a 64-token
micro-batch, with fused attention on and off.

    .venv/bin/python scripts/tools/node_counts.py
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.synthetic import write_tiny_gemma3, write_tiny_llama


def counts(path: Path, flash_attn: bool, n_tokens: int) -> tuple[int, int]:
    """(compute nodes, all nodes) of the graph of a micro-batch of n_tokens (1: a decode step)."""
    model = Model.load(path, [CPUBackend()])
    s = Session(model, SessionParams(n_ctx=128, n_batch=64, n_ubatch=64, flash_attn=flash_attn))
    if n_tokens == 1:
        s.decode(Batch.of_sequence([1, 2, 3], 0))
        s.decode(Batch.of_sequence([7], 3))
    else:
        s.decode(Batch.of_sequence(list(range(1, n_tokens + 1)), 0))
    graph = s.result.sg.graph
    return len(graph.compute_nodes()), len(graph.nodes)


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    for arch, write, n in (("llama", write_tiny_llama, 2), ("gemma3", write_tiny_gemma3, 6)):
        small, large = write(tmp / f"{arch}-{n}.gguf", n_layer=n), write(tmp / f"{arch}-{n + 1}.gguf", n_layer=n + 1)
        for fa in (True, False):
            for n_tokens in (1, 64):
                (c0, a0), (c1, a1) = counts(small, fa, n_tokens), counts(large, fa, n_tokens)
                print(f"{arch:7s} -fa {int(fa)}, {n_tokens:2d} token(s): {c1 - c0:2d} compute nodes per layer "
                      f"({a1 - a0} with views)")


if __name__ == "__main__":
    main()
