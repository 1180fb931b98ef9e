"""Memory checked before it is taken: what a session will allocate (KV cache, compute buffers),
summed per memory pool (the host's RAM; each GPU), against what the pool has free, so that a
context too large for the machine is one line of bad input instead of a numpy allocation error
or an out-of-memory kill.

Weights are not counted: on the CPU they are a memory map of the file (page cache, given back under
pressure), and on a GPU they were loaded before the session, so the free memory already excludes them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ggrun.core.backends.base import Backend
from ggrun.core.errors import BadInput

GiB = 2**30


@dataclass
class Budget:
    """Free bytes per memory pool, read once before a session takes anything (None: unknown)."""

    backends: list[Backend]
    free: dict[str, int | None]

    @staticmethod
    def now(backends: list[Backend]) -> "Budget":
        free: dict[str, int | None] = {}
        for b in backends:
            if b.memory_pool not in free:
                free[b.memory_pool] = b.free_memory()
        return Budget(backends, free)

    def check(self, parts: dict[str, dict[str, int]], advice: str = "lower -c or -ub") -> None:
        """parts: what is needed, by label ("KV cache", "compute buffers"), per backend name. BadInput
        naming the first pool that cannot hold its sum."""
        pool_of = {b.name: b.memory_pool for b in self.backends}
        for pool, free in self.free.items():
            if free is None:
                continue
            need = {label: sum(n for name, n in by_backend.items() if pool_of.get(name) == pool)
                    for label, by_backend in parts.items()}
            total = sum(need.values())
            if total > free:
                detail = ", ".join(f"{label} {n / GiB:.2f} GiB" for label, n in need.items() if n)
                raise BadInput(f"this session needs {total / GiB:.2f} GiB on {pool} ({detail}), "
                               f"{free / GiB:.2f} GiB free; {advice}")
