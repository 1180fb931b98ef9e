"""What the scheduler does with SmolLM2 offloaded onto the stand-in device `sim`: per -ngl setting,
the splits and copies of a one-token decode step, the bytes that cross between backends for that
token (counted by sim itself and by the scheduler), the compute buffer of each backend, and
where weights and KV cache live. Logits are checked against a CPU-only run.

Usage: python scripts/sched_report.py [-m MODEL.gguf] [--ngl 0 15 99] [-c 256]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from ggrun.core.backends.cpu import CPUBackend, set_threads  # noqa: E402
from ggrun.core.backends.sim import SimBackend  # noqa: E402
from ggrun.core.llm.batch import Batch  # noqa: E402
from ggrun.core.llm.model import Model  # noqa: E402
from ggrun.core.llm.session import Session, SessionParams  # noqa: E402
from ggrun.loaders.download import KNOWN_MODELS, model_path  # noqa: E402

PROMPT = "The three most useful things to know about the ocean are"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run_setting(path: Path, ngl: int | None, n_ctx: int) -> dict:
    """Decode the prompt, then one token; the figures of that one-token step. ngl None: CPU only."""
    sim = SimBackend() if ngl is not None else None
    backends = [sim, CPUBackend()] if sim is not None else [CPUBackend()]
    model = Model.load(path, backends, ngl or 0)
    prompt = model.tokenizer.tokenize(PROMPT, add_special=True, parse_special=False)
    s = Session(model, SessionParams(n_ctx=n_ctx, n_batch=64, n_ubatch=64))
    logits = s.decode(Batch.of_sequence(prompt, 0))[-1]
    token = int(np.argmax(logits))
    if sim is not None:
        sim.reset_counters()
    step_logits = s.decode(Batch.of_sequence([token], len(prompt)))[-1]
    sg = s.result.sg
    return dict(
        ngl=ngl, n_layer=model.hp.n_layer, n_prompt=len(prompt), n_kv=s.kv.n_kv(),
        logits=np.stack([logits, step_logits]),
        splits=[(sp.backend.name, sp.nodes[0].name, sp.nodes[-1].name, len(sp.nodes),
                 [(c.srcs[0].name, c.nbytes) for c in sp.copies]) for sp in sg.splits],
        n_copies=sg.n_copies, sched_bytes=sg.copy_bytes,
        sim_in=sim.bytes_in if sim else 0, sim_out=sim.bytes_out if sim else 0,
        buffers=s.sched.buffer_sizes(), weights=model.resident_bytes(), kv=s.kv_bytes_by_backend(),
    )


def report(r: dict, ref: np.ndarray) -> None:
    offloaded = min(r["ngl"], r["n_layer"])
    head = "SIM" if r["ngl"] > r["n_layer"] else "CPU"
    print(f"-ngl {r['ngl']}: {offloaded} of {r['n_layer']} layers on SIM, head on {head}")
    print(f"  one-token decode step (prompt {r['n_prompt']} tokens before it, n_kv {r['n_kv']}):")
    print(f"    splits {len(r['splits'])}, copies {r['n_copies']}")
    for i, (b, first, last, n, copies) in enumerate(r["splits"]):
        what = ", ".join(f"{name} {nbytes} B" for name, nbytes in copies) or "no copies"
        print(f"      split {i}: {b:3s} {n:4d} nodes ({first} .. {last}); {what}")
    total = r["sim_in"] + r["sim_out"]
    logits = " (out: the logits read back)" if head == "SIM" else ""
    print(f"    bytes per generated token: sim in {r['sim_in']} + out {r['sim_out']} = {total}{logits}; "
          f"scheduler's copies {r['sched_bytes']}")
    print("    compute buffer: " + ", ".join(f"{k} {mib(v)} ({v} B)" for k, v in r["buffers"].items()))
    print("    weights: " + ", ".join(f"{k} {mib(v)}" for k, v in r["weights"].items())
          + "; KV cache: " + ", ".join(f"{k} {mib(v)}" for k, v in r["kv"].items()))
    diff = float(np.abs(r["logits"] - ref).max())
    same = int(np.argmax(r["logits"][-1])) == int(np.argmax(ref[-1]))
    print(f"    max |logits - CPU-only| {diff:.2e}; greedy token {'equal' if same else 'DIFFERS'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=model_path(KNOWN_MODELS["smollm2"]))
    ap.add_argument("--ngl", type=int, nargs="+", default=[0, 15, 99])
    ap.add_argument("-c", "--ctx", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int, default=1, help="BLAS threads (default 1)")
    args = ap.parse_args()
    if not args.model.is_file():
        print(f"error: {args.model}: no such file (run `ggrun models pull smollm2`)", file=sys.stderr)
        return 2
    set_threads(args.threads)
    print(f"{args.model.name}, backends [SIM, CPU], context {args.ctx}, prompt {PROMPT!r}")
    ref = run_setting(args.model, None, args.ctx)["logits"]
    for ngl in args.ngl:
        report(run_setting(args.model, ngl, args.ctx), ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
