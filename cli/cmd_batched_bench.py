"""`ggrun bench --batched`: llama-batched-bench's job, options and table (core/llm/batched_bench.py).

Every combination of -npp, -ntg and -npl (comma lists and llama-bench's ranges) is one row, in
llama-batched-bench's order; a row that needs more cells than the context (-c) is skipped, as there.
Without -c the context is the largest any row needs. `-o md` (default) prints llama-batched-bench's
settings line and table, `-o jsonl` its records (one JSON object per line, its field names), `-o json`
the same records as one JSON list. Rows go to stdout as each is measured; Ctrl-C keeps those.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ggrun.cli.common import err_console, load_model
from ggrun.cli.interrupt import Interrupt
from ggrun.core.backends.cpu import set_threads
from ggrun.core.backends.cpu.jit import threads as current_threads
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput, Interrupted
from ggrun.core.llm.batched_bench import BatchedResult, BatchedTest, run_batched, tests_of, warm_up, warm_up_test
from ggrun.core.llm.placement import DeviceSplit
from ggrun.core.llm.session import Session, SessionParams

FORMATS = ("md", "json", "jsonl")
HEADER = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")


@dataclass(frozen=True)
class BatchedBenchSettings:
    """What a `ggrun bench --batched` command line asks for (llama-batched-bench's options)."""

    model: str = "smollm2"
    npp: tuple[int, ...] = (128,)
    ntg: tuple[int, ...] = (128,)
    npl: tuple[int, ...] = (1,)
    shared: bool = False  # -pps
    n_ctx: int | None = None  # None: what the largest row needs
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int | None = None
    poll: int | None = None  # --poll: None, the default level
    n_gpu_layers: int = 0
    split: DeviceSplit = DeviceSplit()
    type_k: DType = DType.F16
    type_v: DType = DType.F16
    flash_attn: int = -1  # 1, 0 or -1 (auto: on)
    graph_reuse: bool = True
    numerics: str = "llama"
    output: str = "md"
    warmup: bool = True  # each row's untimed run first (batched_bench.warm_up_test); --no-warmup skips it

    def tests(self) -> list[BatchedTest]:
        return tests_of(self.npp, self.ntg, self.npl, self.shared)

    @property
    def context(self) -> int:
        """The session's cells: -c, or the most any row needs."""
        return self.n_ctx if self.n_ctx is not None else max(t.n_kv for t in self.tests())

    def check(self) -> None:
        if self.output not in FORMATS:
            raise BadInput(f"-o {self.output}: choose one of {', '.join(FORMATS)} for --batched")
        for flag, values in (("-npp", self.npp), ("-ntg", self.ntg), ("-npl", self.npl)):
            if not values:
                raise BadInput(f"{flag}: no values given")
        if min(self.npl) < 1:
            raise BadInput(f"-npl {','.join(map(str, self.npl))}: every count of sequences must be positive")
        if not any(t.n_kv <= self.context for t in self.tests()):
            raise BadInput(f"no row fits the context (-c {self.context}): every one needs more cells")


def run_batched_bench(s: BatchedBenchSettings, gpu_layers: int) -> None:
    """Load the model once, warm up, then measure and print every row that fits the context, each after an
    untimed run of its own unless --no-warmup (batched_bench.warm_up_test)."""
    s.check()
    m = load_model(s.model, gpu_layers, quiet=True, threads=s.n_threads, numerics=s.numerics, split=s.split,
                   poll=s.poll)
    set_threads(s.n_threads)
    params = SessionParams(n_ctx=s.context, n_batch=s.n_batch, n_ubatch=s.n_ubatch, n_seq_max=max(s.npl),
                           type_k=s.type_k, type_v=s.type_v, graph_reuse=s.graph_reuse, flash_attn=s.flash_attn != 0)
    printer = _Printer(s, gpu_layers)
    with Interrupt() as stop:
        session = stop.watch(Session(m, params))
        try:
            warm_up(session, s.n_batch)
            printer.header()
            for test in s.tests():
                if test.n_kv > s.context:
                    continue
                if s.warmup:
                    warm_up_test(session, test, s.n_batch)
                printer.row(run_batched(session, test, s.n_batch))
        except Interrupted:
            pass
    printer.footer()
    if stop.requested:
        raise Interrupted()


class _Printer:
    """Rows in llama-batched-bench's formats, each printed as soon as it is measured (json at the end)."""

    def __init__(self, s: BatchedBenchSettings, gpu_layers: int) -> None:
        self.s = s
        self.common = {"n_kv_max": s.context, "n_batch": s.n_batch, "n_ubatch": s.n_ubatch,
                       "flash_attn": int(s.flash_attn != 0), "is_pp_shared": int(s.shared),
                       "n_gpu_layers": gpu_layers, "n_threads": current_threads(), "n_threads_batch": current_threads()}
        self.records: list[dict] = []

    def header(self) -> None:
        if self.s.output != "md":
            return
        settings = ", ".join(f"{k} = {v}" for k, v in self.common.items())
        print(f"\nmain: {settings}\n")
        print("|" + " | ".join(f"{h:>{w}s}" for h, w in zip(HEADER, _WIDTHS)) + " |")
        print("|" + "-|-".join("-" * w for w in _WIDTHS) + "-|", flush=True)

    def row(self, r: BatchedResult) -> None:
        t = r.test
        rec = dict(self.common, pp=t.pp, tg=t.tg, pl=t.pl, n_kv=t.n_kv, t_pp=r.t_pp, speed_pp=r.speed_pp,
                   t_tg=r.t_tg, speed_tg=r.speed_tg, t=r.t, speed=r.speed)
        self.records.append(rec)
        if self.s.output == "jsonl":
            print(json.dumps(rec), flush=True)
        elif self.s.output == "md":
            print(f"|{t.pp:6d} | {t.tg:6d} | {t.pl:4d} | {t.n_kv:6d} | {r.t_pp:8.3f} | {r.speed_pp:8.2f} | "
                  f"{r.t_tg:8.3f} | {r.speed_tg:8.2f} | {r.t:8.3f} | {r.speed:8.2f} |", flush=True)

    def footer(self) -> None:
        if self.s.output == "json":
            print(json.dumps(self.records, indent=2), flush=True)
        elif not self.records:
            err_console.print("bench --batched: no row was measured", markup=False)


_WIDTHS = (6, 6, 4, 6, 8, 8, 8, 8, 8, 8)
