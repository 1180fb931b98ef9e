"""Helper processes of the CPU warm-up (precompile.compile_warms starts them): numba compiles one kernel
at a time in a process, so on a machine with cores to spare other processes compile beside the one that
runs the model.

A helper runs the builders it is given a family at a time (precompile.families), from the back of the
list,
claiming each family first in a folder shared with the process that started it (which claims from the
front); it marks each builder it ran in the warm-up's marker folder, and the kernels it compiled reach the
other process through numba's on-disk cache (the same NUMBA_CACHE_DIR, inherited). Its output is
discarded: a helper that fails leaves its builders unmarked, and the starting process runs them itself.

    python -m ggrun.core.backends.cpu.compile_worker CLAIMS MARKERS THREADS   (builder keys on stdin)
"""
from __future__ import annotations

import sys
from pathlib import Path

from ggrun.core.backends.cpu import CPUBackend, precompile, set_threads


def main(argv: list[str]) -> None:
    """Run the builders named on stdin that no other process claimed, families from the back."""
    claims, markers, threads = Path(argv[0]), Path(argv[1]), int(argv[2])
    set_threads(threads)
    by_key = {w.key: w for w in precompile.WARMS}
    warms = [by_key[k] for k in sys.stdin.read().split() if k in by_key]
    backend = CPUBackend()
    for group in reversed(precompile.families(warms)):
        if precompile.claim(claims, group[0].key):
            for w in group:
                precompile.run(backend, w)
                (markers / w.key).touch()


if __name__ == "__main__":
    main(sys.argv[1:])
