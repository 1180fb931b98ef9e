"""What the scheduler does with SmolLM2 offloaded onto stand-in devices (`sim`; several with --devices N,
shared as -sm layer or row): per -ngl setting, the splits and copies of a one-token decode step, the
bytes that cross between backends for that token (counted by the stand-ins themselves and by the
scheduler, by kind: host->device, device->device, device->host), the compute buffer of each backend,
and where weights and KV cache live. Logits are checked against a CPU-only run.

Usage: python scripts/tools/sched_report.py [-m MODEL.gguf] [--ngl 0 15 99] [-c 256] [--devices 2 [--split row]]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ggrun.core.backends.cpu import CPUBackend, set_threads
from ggrun.core.backends.registry import sim_backends, sim_names
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.placement import DeviceSplit
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.download import KNOWN_MODELS, model_path

PROMPT = "The three most useful things to know about the ocean are"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run_setting(path: Path, ngl: int | None, n_ctx: int, devices: int = 1, mode: str = "layer") -> dict:
    """Decode the prompt, then one token; the figures of that one-token step. ngl None: CPU only."""
    sims = sim_backends(devices) if ngl is not None else []
    model = Model.load(path, [*sims, CPUBackend()], ngl or 0, split=DeviceSplit(mode=mode))
    prompt = model.tokenizer.tokenize(PROMPT, add_special=True, parse_special=False)
    s = Session(model, SessionParams(n_ctx=n_ctx, n_batch=64, n_ubatch=64))
    logits = s.decode(Batch.of_sequence(prompt, 0))[-1]
    token = int(np.argmax(logits))
    for sim in sims:
        sim.reset_counters()
    for count in s.sched.copy_counts.values():
        count.n = count.nbytes = 0
    step_logits = s.decode(Batch.of_sequence([token], len(prompt)))[-1]
    sg = s.result.sg
    return dict(
        ngl=ngl, n_layer=model.hp.n_layer, n_prompt=len(prompt), n_kv=s.kv.n_kv(),
        logits=np.stack([logits, step_logits]),
        splits=[(sp.backend.name, sp.nodes[0].name, sp.nodes[-1].name, len(sp.nodes),
                 [(c.srcs[0].name, c.nbytes) for c in sp.copies]) for sp in sg.splits],
        n_copies=sg.n_copies, sched_bytes=sg.copy_bytes, n_slots=sg.n_slots,
        kinds={kind: (c.n, c.nbytes) for kind, c in s.sched.copy_counts.items() if c.n},
        sim_in=sum(x.bytes_in for x in sims), sim_out=sum(x.bytes_out for x in sims),
        layers=[b.name for b in model.placement.layers], head=model.placement.output.name,
        buffers=s.sched.buffer_sizes(), weights=model.resident_bytes(), kv=s.kv_bytes_by_backend(),
    )


def report(r: dict, ref: np.ndarray) -> None:
    on = {name: r["layers"].count(name) for name in dict.fromkeys(r["layers"])}
    where = ", ".join(f"{n} on {name}" for name, n in on.items())
    print(f"-ngl {r['ngl']}: {r['n_layer']} layers: {where}; head on {r['head']}")
    print(f"  one-token decode step (prompt {r['n_prompt']} tokens before it, n_kv {r['n_kv']}):")
    slots = f", pipeline slots {r['n_slots']}" if r["n_slots"] > 1 else ""
    print(f"    splits {len(r['splits'])}, copies {r['n_copies']}{slots}")
    for i, (b, first, last, n, copies) in enumerate(r["splits"]):
        what = ", ".join(f"{name} {nbytes} B" for name, nbytes in copies) or "no copies"
        print(f"      split {i}: {b:4s} {n:4d} nodes ({first} .. {last}); {what}")
    total = r["sim_in"] + r["sim_out"]
    logits = " (out: the logits read back)" if r["head"] != "CPU" else ""
    kinds = ", ".join(f"{kind} {n} ({nbytes} B)" for kind, (n, nbytes) in r["kinds"].items()) or "none"
    print(f"    bytes per generated token: sim in {r['sim_in']} + out {r['sim_out']} = {total}{logits}; "
          f"scheduler's copies {r['sched_bytes']}: {kinds}")
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
    ap.add_argument("--devices", type=int, default=1, help="stand-in devices (default 1)")
    ap.add_argument("--split", choices=("layer", "row"), default="layer", help="-sm over several devices")
    args = ap.parse_args()
    if not args.model.is_file():
        print(f"error: {args.model}: no such file (run `ggrun models pull smollm2`)", file=sys.stderr)
        return 2
    set_threads(args.threads)
    names = ", ".join(sim_names(args.devices))
    print(f"{args.model.name}, backends [{names}, CPU] (-sm {args.split}), context {args.ctx}, prompt {PROMPT!r}")
    ref = run_setting(args.model, None, args.ctx)["logits"]
    for ngl in args.ngl:
        report(run_setting(args.model, ngl, args.ctx, args.devices, args.split), ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
