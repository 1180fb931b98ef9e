"""Which nodes of a model's graphs run off the GPU with every layer offloaded (-ngl 99): for a prompt micro-batch
and a one-token decode step, the scheduler's splits, and the ops of every node assigned to another backend
than CUDA0 (counted by op), plus the CUDA steps that run cupy's array code rather than a kernel of ours
(outside CUDA graphs). On a machine with a GPU:

    python scripts/tools/gpu_fallbacks.py -m MODEL.gguf [-p 64]
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.cuda import CUDABackend
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams


def report(session: Session, what: str) -> None:
    sg = session.result.sg
    print(f"{what}: {len(sg.splits)} splits, {sg.n_copies} copies")
    off = Counter(n.op for sp in sg.splits if not sp.backend.name.startswith("CUDA") for n in sp.nodes)
    print(f"  off the GPU: {dict(off) or 'none'}")
    cupy_steps = Counter()
    for sp in sg.splits:
        if sp.backend.name.startswith("CUDA"):
            steps = sp.backend.prepare(sp.nodes).steps
            cupy_steps.update(s.name for s in steps if not s.capturable and "cuBLAS" not in s.name)
    print(f"  CUDA steps through cupy's array code: {dict(cupy_steps) or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("-p", "--n-prompt", type=int, default=64)
    a = ap.parse_args()
    model = Model.load(a.model, [CUDABackend(0), CPUBackend()], n_gpu_layers=99)
    s = Session(model, SessionParams(n_ctx=256, n_batch=a.n_prompt, n_ubatch=a.n_prompt))
    tokens = list(range(1, a.n_prompt + 1))
    logits = s.decode(Batch.of_sequence(tokens, 0))[-1]
    report(s, f"prompt of {a.n_prompt} tokens")
    s.decode(Batch.of_sequence([int(np.argmax(logits))], a.n_prompt))
    report(s, "decode step")


if __name__ == "__main__":
    main()
