"""A tour of ggrun's three ideas, on a two-layer synthetic llama whose last layer sits on a stand-in
device (SIM, as `-ngl 1` puts it on a GPU), the way in for a newcomer; the test below keeps it true.

    .venv/bin/python -m tests.test_tour

1. Deferred allocation: the worst-case graph is measured without running it, and each backend's planned
   compute buffer is printed against its lower bound (the most bytes alive at once).
2. The scheduler: the graph of a one-token step cut into splits per backend, with the tensors copied in
   at each split's border.
3. Graph reuse: the second one-token step reuses the first's graph; the session says why it rebuilt
   before that.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from ggrun.core.backends.cpu import CPUBackend
from ggrun.core.backends.registry import sim_backends
from ggrun.core.llm.batch import Batch
from ggrun.core.llm.model import Model
from ggrun.core.llm.session import Session, SessionParams
from ggrun.loaders.synthetic import write_tiny_llama

PROMPT = [1, 5, 9, 14, 3, 7]


def tour(path: Path, say: Callable[[str], None] = print) -> Session:
    """Run the tour on the model at `path`, saying each step; returns the session for a look inside."""
    model = Model.load(path, [*sim_backends(1), CPUBackend()], n_gpu_layers=1, numerics="f32")
    where = ", ".join(f"layer {i} on {b.name}" for i, b in enumerate(model.placement.layers))
    say(f"model: {model.hp.n_layer} layers ({where}); output head on {model.placement.output.name}")
    s = Session(model, SessionParams(n_ctx=64, n_ubatch=8))

    say("1. deferred allocation: the worst-case graph measured, nothing run")
    _, plans, _ = s.plan_worst_case()
    for name, plan in plans.items():
        say(f"   {name}: planned {plan.size} B, lower bound {plan.lower_bound} B "
            f"({plan.size / max(plan.lower_bound, 1):.2f}x), {plan.no_reuse} B without reuse")

    s.decode(Batch.of_sequence(PROMPT))
    s.decode(Batch.of_sequence([2], len(PROMPT)))
    say("2. the scheduler: a one-token step's splits and the copies at their borders")
    for i, split in enumerate(s.result.sg.splits):
        copies = ", ".join(f"{c.srcs[0].name} ({c.nbytes} B)" for c in split.copies) or "none"
        say(f"   split {i}: {split.backend.name}, {len(split.nodes)} nodes; copied in: {copies}")

    s.decode(Batch.of_sequence([4], len(PROMPT) + 1))
    say("3. graph reuse: each micro-batch's decision")
    for _, what in s.stats.reuse_log:
        say(f"   {what}")
    return s


def test_the_tour_shows_the_three_ideas(tmp_path):
    lines: list[str] = []
    s = tour(write_tiny_llama(tmp_path / "tour.gguf", n_layer=2), lines.append)
    assert lines[0] == "model: 2 layers (layer 0 on CPU, layer 1 on SIM); output head on CPU"
    planned = [line for line in lines if "planned" in line]
    assert sorted(line.split(":")[0].strip() for line in planned) == ["CPU", "SIM"]
    for line in planned:
        size, bound = (int(line.split(word)[1].split(" B")[0]) for word in ("planned ", "lower bound "))
        assert size >= bound > 0
    splits = [line.strip() for line in lines if line.strip().startswith("split ")]
    assert [line.split(",")[0] for line in splits] == ["split 0: CPU", "split 1: SIM", "split 2: CPU"]
    assert "inp_pos" in splits[1] and "copied in: none" not in splits[2]  # inputs go in, results come back
    assert lines[-3:] == ["   rebuilt: first graph", "   rebuilt: n_tokens 6 -> 1", "   reused"]
    assert s.stats.graphs_reused == 1

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        tour(write_tiny_llama(Path(folder) / "tour.gguf", n_layer=2))
