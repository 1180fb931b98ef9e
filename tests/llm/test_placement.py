"""Placement over several devices (core/llm/placement.py), against llama.cpp's rules written out by hand:
with -ngl N the last N layers are offloaded and the output head counts as one more offloaded layer when
N exceeds the layer count; under -sm layer, offloaded layer i (the head as i = n_layer) goes to the first
device whose cumulative -ts share exceeds (i - first offloaded) / offloaded count; without -ts the shares
are the devices' free memory; -sm none keeps -mg's device only; -sm row keeps every offloaded layer on
-mg's device and splits matrices by rows, each device's rows starting at its share rounded down to 16."""
from __future__ import annotations

import pytest

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.sim import SimBackend
from ggrun.core.errors import BadInput
from ggrun.core.llm.placement import DeviceSplit, Placement, split_points

GiB = 2**30


@pytest.fixture
def machine():
    """Two stand-in devices and the CPU, in the registry's order."""
    return [SimBackend(name="SIM0"), SimBackend(name="SIM1"), CPUBackend()]


def names(p: Placement) -> tuple[list[str], str]:
    return [b.name for b in p.layers], p.output.name


def place(machine, n_layer: int = 4, ngl: int = 99, **split) -> Placement:
    return Placement.for_layers(n_layer, machine, ngl, DeviceSplit(**split))


def test_even_split_counts_the_head_as_a_layer(machine):
    # 5 offloaded (4 layers + head), points [0.5, 1]: 0/5, 1/5, 2/5 -> SIM0; 3/5 and the head's 4/5 -> SIM1
    assert names(place(machine, tensor_split=(1, 1))) == (["SIM0", "SIM0", "SIM0", "SIM1"], "SIM1")


def test_proportions_follow_ts(machine):
    # points [0.75, 1]: 0, .2, .4, .6 < .75 -> SIM0; the head at .8 -> SIM1
    assert names(place(machine, tensor_split=(3, 1))) == (["SIM0"] * 4, "SIM1")
    # points [0.25, 1]: 0/5 and 1/5 < .25
    assert names(place(machine, tensor_split=(1, 3))) == (["SIM0", "SIM0", "SIM1", "SIM1"], "SIM1")
    # a device given 0 gets nothing
    assert names(place(machine, tensor_split=(0, 1))) == (["SIM1"] * 4, "SIM1")


def test_partial_offload_splits_only_the_offloaded_layers(machine):
    # -ngl 2 of 4: layers 2 and 3 offloaded, 2 of them (the head stays on the CPU): 0/2 -> SIM0, 1/2 -> SIM1
    assert names(place(machine, ngl=2, tensor_split=(1, 1))) == (["CPU", "CPU", "SIM0", "SIM1"], "CPU")
    assert names(place(machine, ngl=0, tensor_split=(1, 1))) == (["CPU"] * 4, "CPU")


def test_without_ts_the_split_follows_free_memory(machine):
    for i, free in enumerate((3 * GiB, 1 * GiB)):  # two devices with memory of their own, as GPUs
        machine[i].memory_pool = f"GPU{i}"
        machine[i].free_memory = lambda free=free: free
    assert split_points(machine[:2]) == [0.75, 1.0]
    assert names(place(machine)) == names(place(machine, tensor_split=(3, 1)))
    assert names(place(machine, tensor_split=(0, 0))) == names(place(machine, tensor_split=(3, 1)))


def test_devices_that_cannot_tell_their_free_memory_share_evenly(machine):
    machine[0].memory_pool = "GPU0"
    machine[0].free_memory = lambda: None
    assert split_points(machine[:2]) == [0.5, 1.0]


def test_devices_drawing_on_one_memory_share_it_evenly(machine):
    """Stand-in devices all draw on the host's memory: read once, so their shares are exactly equal."""
    reads = iter([3 * GiB, 1 * GiB])
    for d in machine[:2]:
        d.free_memory = lambda: next(reads)
    assert split_points(machine[:2]) == [0.5, 1.0]


def test_split_mode_none_uses_the_main_gpu_only(machine):
    p = place(machine, mode="none", main_gpu=1)
    assert names(p) == (["SIM1"] * 4, "SIM1")
    assert [b.name for b in p.backends] == ["SIM1", "CPU"] and not p.pipeline_parallel


def test_devices_are_taken_in_the_order_dev_names_them(machine):
    p = place(machine, devices=("SIM1", "SIM0"), tensor_split=(1, 1))
    assert names(p) == (["SIM1", "SIM1", "SIM1", "SIM0"], "SIM0")
    assert [b.name for b in p.backends] == ["SIM1", "SIM0", "CPU"]
    assert names(place(machine, devices=())) == (["CPU"] * 4, "CPU")
    assert names(place(machine, devices=("SIM1",))) == (["SIM1"] * 4, "SIM1")


def test_row_split_keeps_layers_on_the_main_device_and_splits_matrices(machine):
    p = place(machine, mode="row", tensor_split=(3, 1), main_gpu=1)
    assert names(p) == (["SIM1"] * 4, "SIM1")
    assert p.rows is not None and p.rows.main.name == "SIM1"
    assert [(d.name, lo, hi) for d, lo, hi in p.row_ranges("blk.0.attn_q.weight", (64, 64))] == \
        [("SIM0", 0, 48), ("SIM1", 48, 64)]
    # 40 rows at 1,1: 20 rounds down to 16
    assert [(d.name, lo, hi) for d, lo, hi in p.rows.ranges(40)] == [("SIM0", 0, 16), ("SIM1", 16, 40)]
    # 16 rows at 15,1: SIM1's start 15 rounds down to 0, so SIM0 gets none
    assert [(d.name, lo, hi) for d, lo, hi in place(machine, mode="row", tensor_split=(15, 1)).rows.ranges(16)] == \
        [("SIM1", 0, 16)]
    # vectors, the embedding, and layers left on the CPU stay whole
    assert p.row_ranges("blk.0.attn_norm.weight", (64,)) is None
    assert p.row_ranges("token_embd.weight", (300, 64)) is None
    partial = place(machine, ngl=2, mode="row")
    assert partial.row_ranges("blk.0.attn_q.weight", (64, 64)) is None
    assert partial.row_ranges("blk.3.attn_q.weight", (64, 64)) is not None
    assert partial.row_ranges("output.weight", (300, 64)) is None  # the head stays on the CPU at -ngl 2


def test_pipelining_needs_several_devices_and_everything_offloaded(machine):
    assert place(machine, tensor_split=(1, 1)).pipeline_parallel
    assert not place(machine, ngl=4, tensor_split=(1, 1)).pipeline_parallel  # the head on the CPU
    assert not place(machine, tensor_split=(1, 0)).pipeline_parallel  # one device holds everything
    assert not place(machine, mode="row").pipeline_parallel
    assert not place(machine[1:]).pipeline_parallel


@pytest.mark.parametrize("split, fragment", [
    (dict(tensor_split=(1, 1, 1)), "-ts 1,1,1: 3 proportions for 2 device(s) (SIM0, SIM1)"),
    (dict(main_gpu=2), "-mg 2: the devices used are numbered 0..1"),
    (dict(devices=("SIM1",), main_gpu=1), "-mg 1: the devices used are numbered 0..0 (SIM1)"),
    (dict(devices=("CUDA0",)), "-dev CUDA0: no device named CUDA0 (available: SIM0, SIM1"),
    (dict(devices=("SIM0", "SIM0")), "SIM0 is given twice"),
    (dict(mode="tensor"), "-sm tensor: choose one of none, layer, row"),
    (dict(tensor_split=(1, -1)), "must not be negative"),
    (dict(main_gpu=-1), "-mg -1 must not be negative"),
])
def test_bad_splits_are_one_line_of_bad_input(machine, split, fragment):
    with pytest.raises(BadInput) as err:
        place(machine, **split)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_no_devices_at_all(machine):
    cpu_only = machine[-1:]
    assert names(place(cpu_only, tensor_split=())) == (["CPU"] * 4, "CPU")
    with pytest.raises(BadInput, match="-mg 1: no device is used"):
        place(cpu_only, main_gpu=1)
    with pytest.raises(BadInput, match=r"-ts 1: 1 proportion for 0 device\(s\) \(none\)"):
        place(cpu_only, tensor_split=(1,))
