"""Where a model's parts live: the backend of each layer (its weights and its KV cache), of the input
(token embedding) and of the output head, as llama.cpp's -ngl, -dev, -sm, -ts and -mg decide it
(llama_model::load_tensors): the last -ngl layers are offloaded, the output head too when -ngl exceeds
the layer count, the embedding stays on the CPU.

- `-sm layer` (the default): offloaded layer i goes to the device whose cumulative share of -ts covers
  i / (offloaded layers, the output counted as one more when it is offloaded); without -ts the shares
  follow each device's free memory. The output head lands on the last device.
- `-sm none`: only -mg's device.
- `-sm row`: the offloaded layers and their KV cache live on -mg's device, but each of their matrices
  (and the output head's) is split by rows over the devices in proportion to -ts (core/rowsplit.py).

It decides and never touches memory; bad -dev, -ts or -mg values are one BadInput line each.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ggrun.core.backends.base import Backend
from ggrun.core.errors import BadInput

SPLIT_MODES = ("none", "layer", "row")
ROW_ROUNDING = 16  # a device's rows of a split matrix start at a multiple of this (llama.cpp rounds too)


@dataclass(frozen=True)
class DeviceSplit:
    """-dev, -sm, -ts and -mg as given on the command line."""

    devices: tuple[str, ...] | None = None  # -dev: names in order; None: every device; (): none, the CPU only
    mode: str = "layer"  # -sm
    tensor_split: tuple[float, ...] = ()  # -ts: proportions per device; empty or all zero: by free memory
    main_gpu: int = 0  # -mg: index among the devices used

    def check(self) -> None:
        """Values wrong whatever the machine: BadInput."""
        if self.mode not in SPLIT_MODES:
            raise BadInput(f"-sm {self.mode}: choose one of {', '.join(SPLIT_MODES)}")
        if any(x < 0 for x in self.tensor_split):
            raise BadInput(f"-ts {format_split(self.tensor_split)}: proportions must not be negative")
        if self.main_gpu < 0:
            raise BadInput(f"-mg {self.main_gpu} must not be negative")


def format_split(values: tuple[float, ...]) -> str:
    return ",".join(f"{x:g}" for x in values)


def select_devices(backends: list[Backend], split: DeviceSplit) -> list[Backend]:
    """The devices the model may use (every backend but the CPU, which is last): -dev's, in its order,
    or all; with -sm none only -mg's. BadInput names an unknown device, -ts values beyond the devices,
    or -mg beyond them."""
    split.check()
    devices = list(backends[:-1])
    names = ", ".join(b.name for b in devices) or "none"
    if split.devices is not None:
        by_name = {b.name: b for b in devices}
        for name in split.devices:
            if name not in by_name:
                raise BadInput(f"-dev {','.join(split.devices)}: no device named {name} "
                               f"(available: {names}; see --list-devices)")
            if split.devices.count(name) > 1:
                raise BadInput(f"-dev {','.join(split.devices)}: {name} is given twice")
        devices = [by_name[name] for name in split.devices]
    if len(split.tensor_split) > len(devices):
        n = len(split.tensor_split)
        raise BadInput(f"-ts {format_split(split.tensor_split)}: {n} proportion{'s' if n > 1 else ''} for "
                       f"{len(devices)} device(s) ({', '.join(b.name for b in devices) or 'none'})")
    if split.main_gpu > 0 and split.main_gpu >= len(devices):
        raise BadInput(f"-mg {split.main_gpu}: the devices used are numbered 0..{len(devices) - 1} "
                       f"({', '.join(b.name for b in devices) or 'none'})" if devices else
                       f"-mg {split.main_gpu}: no device is used (see --list-devices)")
    if split.mode == "none" and devices:
        return [devices[split.main_gpu]]
    return devices


def split_points(devices: list[Backend], tensor_split: tuple[float, ...] = ()) -> list[float]:
    """Each device's cumulative share, the last 1.0 (llama.cpp's split points): -ts's proportions, or
    when none is given (or all are zero) each device's free memory, read once per memory pool and
    shared evenly by the devices drawing on one pool (stand-in devices all draw on the host's); equal
    shares where a device cannot tell its free memory."""
    weights = [float(x) for x in tensor_split] + [0.0] * (len(devices) - len(tensor_split))
    if not any(weights):
        free: dict[str, int | None] = {}
        for d in devices:
            if d.memory_pool not in free:
                free[d.memory_pool] = d.free_memory() if len(devices) > 1 else 1
        sharing = [sum(1 for e in devices if e.memory_pool == d.memory_pool) for d in devices]
        known = all(free.values())
        weights = [free[d.memory_pool] / n if known else 1.0 for d, n in zip(devices, sharing)]
    total, points = 0.0, []
    for w in weights:
        total += w
        points.append(total)
    return [p / total for p in points]


@dataclass(frozen=True)
class RowSplit:
    """How -sm row splits a matrix over the devices: each device's cumulative share, and the main device
    (-mg) where the partial products are gathered."""

    devices: tuple[Backend, ...]
    points: tuple[float, ...]
    main: Backend

    def ranges(self, n_rows: int) -> list[tuple[Backend, int, int]]:
        """(device, first row, end row) of each device that gets rows, in device order: a device's rows
        start at its share's start rounded down to ROW_ROUNDING; the last device takes the rest
        (llama.cpp's get_row_split)."""
        starts = [0] + [_round_down(n_rows * p) for p in self.points[:-1]] + [n_rows]
        return [(d, lo, hi) for d, lo, hi in zip(self.devices, starts, starts[1:]) if hi > lo]


def _round_down(rows: float) -> int:
    n = int(rows)
    return n - n % ROW_ROUNDING


@dataclass
class Placement:
    """Which backend holds each part of the model; `backends` are those a scheduler runs it on (the
    devices used, the CPU last)."""

    layers: list[Backend]
    input: Backend
    output: Backend
    rows: RowSplit | None = None  # -sm row over several devices: how matrices split
    backends: list[Backend] = field(default_factory=list)

    @staticmethod
    def for_layers(n_layer: int, backends: list[Backend], n_gpu_layers: int,
                   split: DeviceSplit | None = None) -> "Placement":
        """The placement llama.cpp gives -ngl n_gpu_layers and `split` over `backends` (devices first,
        the CPU last)."""
        split = split or DeviceSplit()
        cpu = backends[-1]
        devices = select_devices(backends, split)
        ngl = max(0, n_gpu_layers) if devices else 0
        first = max(n_layer - ngl, 0)
        n_offloaded = min(ngl, n_layer + 1)  # the output head counts as a layer
        main = devices[split.main_gpu] if split.mode == "row" and devices else None
        points = split_points(devices, split.tensor_split) if devices and main is None else []

        def home(il: int) -> Backend:
            if il < first or il - first >= n_offloaded:
                return cpu
            if main is not None:
                return main
            return devices[min(bisect.bisect_right(points, (il - first) / n_offloaded), len(devices) - 1)]

        rows = None
        if main is not None and len(devices) > 1:
            rows = RowSplit(tuple(devices), tuple(split_points(devices, split.tensor_split)), main)
        return Placement(layers=[home(il) for il in range(n_layer)], input=cpu, output=home(n_layer), rows=rows,
                         backends=[*devices, cpu])

    @property
    def devices(self) -> list[Backend]:
        """The devices that hold a part of the model, in the scheduler's order."""
        used = {id(b) for b in self.layers + [self.output]}
        if self.rows is not None:
            used |= {id(b) for b in self.rows.devices}
        return [b for b in self.backends[:-1] if id(b) in used]

    @property
    def pipeline_parallel(self) -> bool:
        """llama.cpp's condition for pipelining micro-batches over devices: layers split over several
        devices (-sm layer) with every layer and the output head offloaded."""
        on_devices = all(b is not self.input for b in self.layers) and self.output is not self.input
        return self.rows is None and len(self.devices) > 1 and on_devices

    def home(self, name: str) -> Backend:
        """The backend of a tensor by its GGUF name (for a row-split matrix: where its product is gathered)."""
        if name.startswith("blk."):
            return self.layers[int(name.split(".")[1])]
        if name.startswith("token_embd"):
            return self.input
        return self.output

    def row_ranges(self, name: str, shape: tuple[int, ...]) -> list[tuple[Backend, int, int]] | None:
        """With -sm row, the parts of a matrix of an offloaded layer or of the offloaded output head
        (device, first row, end row); None for a tensor kept whole."""
        if self.rows is None or len(shape) != 2 or name.startswith("token_embd"):
            return None
        if self.home(name) is self.input:
            return None
        return self.rows.ranges(shape[0])

    def pieces(self, name: str, shape: tuple[int, ...]) -> list[tuple[Backend, int, int]]:
        """Where each row range of a tensor lives: its parts when split by rows, else all of it at home."""
        return self.row_ranges(name, shape) or [(self.home(name), 0, shape[0] if shape else 1)]
