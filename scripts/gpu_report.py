"""Decode speed and agreement of the CUDA backend on a SmolLM2-shaped synthetic model
(random weights, the real model's shapes), measured beside the CPU in one run.

Usage: python scripts/gpu_report.py [--tokens 64]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from ggrun.core.backends.cpu import CPUBackend  # noqa: E402
from ggrun.core.backends.registry import usable_backends  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402
from tests.synth import write_tiny_llama  # noqa: E402


def decode_speed(model: Model, n_tokens: int, prompt: list[int]) -> tuple[float, float, np.ndarray]:
    s = Session(model, SessionParams(n_ctx=1024, n_ubatch=512))
    t0 = time.perf_counter()
    logits = s.decode(Batch.of_sequence(prompt))
    pp = len(prompt) / (time.perf_counter() - t0)
    first = logits[-1].copy()
    tok, pos = int(first.argmax()), len(prompt)
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        tok = int(s.decode(Batch.of_sequence([tok], pos))[-1].argmax())
        pos += 1
    return pp, n_tokens / (time.perf_counter() - t0), first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    backends = usable_backends()
    print("backends:", ", ".join(f"{b.name} ({b.device})" for b in backends))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_llama(Path(tmp) / "smol-shaped.gguf", n_layer=30, n_embd=576, n_head=9, n_head_kv=3,
                                n_ff=1536, n_ctx_train=2048)
        prompt = list(range(5, 5 + 128))
        rows = []
        for label, bes, ngl in (("CPU", [CPUBackend()], 0), ("GPU -ngl 31", backends, 31)):
            m = Model.load(path, bes, ngl)
            pp, tg, first = decode_speed(m, args.tokens, prompt)
            rows.append((label, pp, tg, first))
            print(f"{label:12s} pp{len(prompt)} {pp:8.1f} t/s   tg{args.tokens} {tg:8.1f} t/s")
        diff = float(np.abs(rows[0][3] - rows[1][3]).max())
        print(f"max |logit difference| GPU vs CPU after the prompt: {diff:.2e}")
        print(f"tg speed-up GPU/CPU: {rows[1][2] / rows[0][2]:.2f}x, pp speed-up: {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
