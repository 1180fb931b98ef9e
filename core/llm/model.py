"""A loaded model: hyperparameters, tokenizer, and weights placed on backends per layer as
core/llm/placement.py decides (`n_gpu_layers`: the last N repeating layers on the devices, split
over them by -sm/-ts/-mg, the output head too when N exceeds the layer count; the token embedding
stays on the CPU). With -sm row a matrix is loaded as its row ranges, one weight per device, behind
a handle (core/rowsplit.py).

Weights stay as the file holds them (GGUF blocks, memory-mapped on the CPU); only a backend
without kernels for block formats gets them decoded to f32 at load.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ggrun.core import rowsplit
from ggrun.core.backends.base import Backend
from ggrun.core.context import ImmediateContext
from ggrun.core.dtypes import DType
from ggrun.core.errors import BadInput
from ggrun.core.llm import checks
from ggrun.core.llm.archs import Arch, arch_for
from ggrun.core.llm.budget import Budget
from ggrun.core.llm.hparams import HParams
from ggrun.core.llm.placement import DeviceSplit, Placement
from ggrun.core.llm.weights import Weights
from ggrun.core.quants import vec_dot_blocks
from ggrun.loaders.gguf_file import GGUFFile, open_gguf
from ggrun.loaders.tensor_values import check_tensor_values
from ggrun.loaders.tokenizer import Tokenizer

Progress = Callable[[int, int], None]

# "llama": round operands as llama.cpp's CPU kernels do (8-bit activation blocks against quantized
# weights, f16 against the f16 KV cache, GELU through an f16 table), to agree with its numbers.
# "f32": plain f32 arithmetic, where results do not depend on how tokens are batched beyond
# float rounding (the 8-bit rounding magnifies such last-bit differences into visible ones).
NUMERICS = ("llama", "f32")


class Model:
    """Everything read from one GGUF file, ready to build graphs."""

    def __init__(self, gf: GGUFFile, hp: HParams, arch: Arch, tokenizer: Tokenizer, weights: Weights,
                 placement: Placement, backends: list[Backend], contexts: dict[str, ImmediateContext],
                 load_seconds: float, numerics: str = "llama") -> None:
        self.gguf = gf
        self.path = Path(gf.path)
        self.hp = hp
        self.arch = arch
        self.tokenizer = tokenizer
        self.weights = weights
        self.placement = placement
        self.backends = backends
        self.contexts = contexts
        self.load_seconds = load_seconds
        self.numerics = numerics

    @property
    def n_params(self) -> int:
        return sum(i.n_elements for i in self.gguf.tensors.values())

    @property
    def file_bytes(self) -> int:
        return self.gguf.file_bytes

    def resident_bytes(self) -> dict[str, int]:
        return {name: c.nbytes for name, c in self.contexts.items()}

    @property
    def type_label(self) -> str:
        """The dominant stored type, like llama-bench's model type (e.g. Q4_1)."""
        ft = self.gguf.get("general.file_type")
        counts: dict[str, int] = {}
        for info in self.gguf.tensors.values():
            counts[info.qtype.name] = counts.get(info.qtype.name, 0) + info.n_bytes
        return max(counts, key=counts.get) if counts else str(ft)

    @staticmethod
    def read_hparams(gf: GGUFFile) -> tuple[HParams, Arch]:
        """Hyperparameters and architecture, validated (core.llm.checks) before anything uses them."""
        arch = arch_for(checks.architecture(gf), str(gf.path))
        checks.check_metadata(gf, arch.keys)
        hp = arch.hparams(gf)
        checks.check_hparams(gf, hp, arch.keys)
        checks.check_tensors(gf, hp, arch.layer_tensors, arch.required_tensors(hp))
        return hp, arch

    @staticmethod
    def load(path: str | Path, backends: list[Backend], n_gpu_layers: int = 0,
             progress: Progress | None = None, metadata_only: bool = False, numerics: str = "llama",
             split: DeviceSplit | None = None, check_tensors: bool = False) -> "Model":
        """Open, validate and load a GGUF model onto `backends` (priority order, CPU last), the devices
        among them picked and shared as `split` (-dev, -sm, -ts, -mg) says. Its small float tensors are
        checked for NaN and infinity, every tensor with check_tensors (--check-tensors).

        With metadata_only, weights are placed in virtual buffers: shapes and backends are
        real, no tensor data is read and no weight memory is taken (for `ggrun measure`).
        """
        if numerics not in NUMERICS:
            raise BadInput(f"numerics '{numerics}' is not one of {', '.join(NUMERICS)}")
        t0 = time.perf_counter()
        gf = open_gguf(path)
        hp, arch = Model.read_hparams(gf)
        tokenizer = Tokenizer.from_metadata(gf.metadata)
        placement = Placement.for_layers(hp.n_layer, backends, n_gpu_layers, split)
        contexts: dict[str, ImmediateContext] = {}

        def ctx_for(backend: Backend) -> ImmediateContext:
            if backend.name not in contexts:
                contexts[backend.name] = ImmediateContext(backend, "weights", virtual=metadata_only,
                                                          source=str(gf.path))
            return contexts[backend.name]

        if not metadata_only:
            check_tensor_values(gf, every=check_tensors)
            _check_device_weights(gf, placement)
        tensors = {}
        total = gf.file_bytes
        done = 0
        tied = "output.weight" not in gf.tensors and placement.output is placement.input
        for source, info in gf.tensors.items():
            for name, rows in _parts(arch, hp, source, info.shape):
                shape = (rows[1] - rows[0],) + tuple(info.shape[1:])
                ranges = placement.row_ranges(name, shape)
                if ranges:
                    tensors[name] = _split_weight(ctx_for, placement, gf, name, source, numerics, rows)
                    continue
                ctx = ctx_for(placement.home(name))
                tensors[name] = _weight(ctx, gf, name, source, numerics, rows)
                # a matrix gets its kernels' layout; the embedding only when it is the head too (then its
                # rows are still read as stored, a page per token)
                if (name != "token_embd.weight" or tied) and ctx.prepare_weight(tensors[name]) and not metadata_only:
                    gf.evict(source)  # read again only by long prompts' products: not held twice meanwhile
            done += info.n_bytes
            if progress:
                progress(done, total)
        for ctx in contexts.values():
            ctx.save_prepared()
        if "output.weight" not in tensors:  # tied head: the embedding serves as output weight
            if placement.output is placement.input:
                tensors["output.weight"] = tensors["token_embd.weight"]
            elif placement.row_ranges("output.weight", gf.tensors["token_embd.weight"].shape):
                tensors["output.weight"] = _split_weight(ctx_for, placement, gf, "output.weight",
                                                         "token_embd.weight", numerics)
            else:
                tensors["output.weight"] = _weight(ctx_for(placement.output), gf, "output.weight",
                                                   "token_embd.weight", numerics)
        weights = Weights(tensors, str(gf.path), tied="output.weight" not in gf.tensors)
        return Model(gf, hp, arch, tokenizer, weights, placement, placement.backends, contexts,
                     time.perf_counter() - t0, numerics)


def _weight(ctx: ImmediateContext, gf: GGUFFile, name: str, source: str, numerics: str,
            rows: tuple[int, int] | None = None):
    """Tensor `source` (its rows [lo, hi) when `rows` is given) in ctx as `name`: its stored bytes
    where the backend keeps block formats, else decoded to f32. With llama numerics, a weight stored
    block-quantized meets 8-bit-rounded activations in mul_mat, as in llama.cpp's CPU kernels
    (`act_quant`: the blocks of ggml's vec_dot for the type, quants.vec_dot_blocks)."""
    info = gf.tensors[source]
    dtype = DType.of_ggml(info.qtype.name) if ctx.backend.stores_blocks else DType.F32
    lo, hi = rows if rows is not None else (0, info.shape[0])
    shape = (hi - lo,) + tuple(info.shape[1:])
    if ctx.virtual:
        t = ctx.new_tensor(name, dtype, shape, weight=True)
    elif dtype is DType.F32 and info.qtype.name != "F32":
        t = ctx.from_array(name, gf.load_f32(source)[lo:hi])
    else:
        raw = gf.raw(source)
        row_bytes = info.n_bytes // info.shape[0]
        t = ctx.from_bytes(name, dtype, shape, raw[lo * row_bytes:hi * row_bytes])
    qtype = info.qtype.name
    if numerics == "llama" and qtype not in ("F32", "F16", "BF16"):
        t.params["act_quant"] = vec_dot_blocks(qtype)
    return t


def _parts(arch: Arch, hp: HParams, source: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, int]]]:
    """The weights tensor `source` is loaded as, each with its rows of it: itself whole, or for a matrix the
    architecture stores fused (phi3's attn_qkv) its parts (attn_q, attn_k, attn_v)."""
    whole = [(source, (0, shape[0] if shape else 1))]
    if not source.startswith("blk."):
        return whole
    prefix, short = source.split(".", 2)[:2], source.split(".", 2)[2]
    parts, at = [], 0
    for part, rows in arch.fused(hp, short):
        parts.append((".".join(prefix + [part]), (at, at + rows)))
        at += rows
    return parts or whole


def _split_weight(ctx_for, placement: Placement, gf: GGUFFile, name: str, source: str, numerics: str,
                  rows: tuple[int, int] | None = None):
    """Matrix `source` (its rows [lo, hi) when `rows` is given) as `name` split by rows over the devices
    (-sm row): one weight per device's rows, behind a handle whose products gather on the main device."""
    info = gf.tensors[source]
    first, end = rows if rows is not None else (0, info.shape[0])
    shape = (end - first,) + tuple(info.shape[1:])
    parts = [_weight(ctx_for(d), gf, f"{name}@rows{lo}-{hi}", source, numerics, (first + lo, first + hi))
             for d, lo, hi in placement.row_ranges(name, shape)]
    return rowsplit.handle(name, parts[0].dtype, shape, parts, placement.rows.main.name)


def _check_device_weights(gf: GGUFFile, placement: Placement) -> None:
    """The weights a GPU is given must fit in its free memory before any is copied (BadInput naming
    the need and what is free; lower -ngl). Host weights are a memory map of the file: not counted."""
    need: dict[str, int] = {}
    for name, info in gf.tensors.items():
        for backend, lo, hi in placement.pieces(name, info.shape):
            if backend.memory_pool != "CPU":
                nbytes = info.n_bytes if backend.stores_blocks else 4 * info.n_elements
                need[backend.name] = need.get(backend.name, 0) + nbytes * (hi - lo) // max(info.shape[0], 1)
    if need:
        Budget.now(placement.backends).check({"weights": need}, advice="lower -ngl")

