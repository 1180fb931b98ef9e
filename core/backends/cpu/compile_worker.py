"""Helper processes of the CPU warm-up (warmup.compile_warms): numba compiles one kernel at a time in a
process, so on a machine with cores to spare other processes compile beside the one that runs the model.

A helper runs the builders it is given a family at a time (warmup.families), from the back of the list,
claiming each family first in a folder shared with the process that started it (which claims from the
front); it marks each builder it ran in the warm-up's marker folder, and the kernels it compiled reach the
other process through numba's on-disk cache (the same NUMBA_CACHE_DIR, inherited). Its output is
discarded: a helper that fails leaves its builders unmarked, and the starting process runs them itself.

    python -m ggrun.core.backends.cpu.compile_worker CLAIMS MARKERS THREADS   (builder keys on stdin)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def claim(claims: Path, key: str) -> bool:
    """Whether this process got the family whose first builder is `key` (no other process has it)."""
    try:
        os.close(os.open(claims / key, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class Helpers:
    """`n` helper processes over builders `keys`, for a `with` block; claim() claims for this process.
    Leaving the block waits for the helpers (stops them if the block raised) and removes the claims."""

    def __init__(self, n: int, keys: list[str]) -> None:
        self.n = n
        self.keys = keys
        self.claims = Path()
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Helpers":
        from ggrun.core.backends.cpu import jit, warmup

        self.claims = Path(tempfile.mkdtemp(prefix="ggrun-compile-"))
        cmd = [sys.executable, "-m", __name__, str(self.claims), str(warmup.marker_dir()), str(jit.threads())]
        for _ in range(self.n):
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            proc.stdin.write("\n".join(self.keys).encode())
            proc.stdin.close()
            self.procs.append(proc)
        return self

    def claim(self, key: str) -> bool:
        return claim(self.claims, key)

    def __exit__(self, kind, *rest) -> None:
        for proc in self.procs:
            if kind is not None:
                proc.terminate()
            proc.wait()
        shutil.rmtree(self.claims, ignore_errors=True)


def main(argv: list[str]) -> None:
    """Run the builders named on stdin that no other process claimed, families from the back."""
    from ggrun.core.backends.cpu import CPUBackend, set_threads, warmup

    claims, markers, threads = Path(argv[0]), Path(argv[1]), int(argv[2])
    set_threads(threads)
    by_key = {w.key: w for w in warmup.WARMS}
    warms = [by_key[k] for k in sys.stdin.read().split() if k in by_key]
    backend = CPUBackend()
    for group in reversed(warmup.families(warms)):
        if claim(claims, group[0].key):
            for w in group:
                warmup.run(backend, w)
                (markers / w.key).touch()


if __name__ == "__main__":
    main(sys.argv[1:])
