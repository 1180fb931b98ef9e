"""Whether other work crowds this process off the cores, and so whether a decode step's kernels may split
across the threads (threads.py's polling policy) or run on one.

A split kernel waits for all its threads. On cores shared with busy processes a polling thread spends
its share of a core while it polls, so the scheduler soon puts it behind them, and every split kernel
then waits most of a time slice for it: a Qwen3-0.6B-shaped decode step at -t 2 took ~250 ms here
beside busy processes, where one thread takes ~20. So:
- while steps split, the kernel's count of the time this process's threads spent runnable but not
  running (/proc/self/task/*/schedstat, its second field) is read after each decode step (products of a
  few rows of activations); past CROWDED_SHARE of the wall time since the watch began (and MIN_WAIT_NS: a
  core taken for a few milliseconds is no crowd), the process is crowded;
- crowded, decode steps run on one thread for at least HOLD of them, and then until Linux's count of
  runnable threads (/proc/loadavg) has shown a core to spare for the others ROOM_STEPS steps running;
  then they split again and the watch restarts. Each return that meets the crowd again doubles the hold
  (up to MAX_HOLD), so a count that misleads (a container's view of a larger host) costs little.
Prompt-sized steps (backend.decode_step tells them apart) always split: their kernels are long beside a
wait.

It never changes what a kernel computes: a one-thread step runs the same chunks, one after another.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ggrun.core.backends.cpu.threads import usable_cpus

TASKS = "/proc/self/task"
LOADAVG = "/proc/loadavg"
CROWDED_SHARE = 0.15    # run-queue wait over wall time above which the process is crowded
MIN_WALL_NS = 2_000_000  # wall time the watch needs before it judges
# run-queue wait below which it is not a crowd, whatever its share: on a quiet 2-core EPYC a decode step of a
# Qwen3-0.6B-shaped model (~13 ms) met 2.4-6.8 ms waits now and then, each sending ~48 steps to one thread (tg128
# 66-76 t/s where runs without one gave 79-84); beside busy processes a step waits ~200 ms
MIN_WAIT_NS = 10_000_000
HOLD = 32               # decode steps on one thread after the first crowded watch, at least
MAX_HOLD = 1024
ROOM_STEPS = 16         # steps in a row with a core to spare before splitting again


def _read(path: str) -> bytes:
    """A small /proc file's bytes (os.read: a tenth of pathlib's cost, read after every decode step)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 256)
    finally:
        os.close(fd)


def run_queue_wait_ns() -> int | None:
    """Nanoseconds this process's threads have waited runnable for a core, or None where Linux does not
    say (no /proc, or a kernel without schedstat)."""
    total = 0
    try:
        names = os.listdir(TASKS)
    except OSError:
        return None
    for name in names:
        try:
            total += int(_read(f"{TASKS}/{name}/schedstat").split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended since the listing
    return total


def others_running() -> int | None:
    """Runnable threads on the machine besides the caller (/proc/loadavg's fourth field), None where unknown."""
    try:
        return int(_read(LOADAVG).split()[3].split(b"/")[0]) - 1
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Crowding:
    """The watch's state: splitting and measuring since `start`, or holding decode steps on one thread."""
    threads: int = 1
    held: bool = False
    hold: int = 0                 # decode steps still to run on one thread before looking for room
    room: int = 0                 # steps in a row that found a core to spare for the other threads
    next_hold: int = HOLD
    start: tuple[int, int] | None = None  # (wall ns, wait ns) where the watch began

    def one_thread(self, threads: int) -> bool:
        """Whether the next decode step of a `threads`-thread process runs on one thread."""
        self.threads = threads
        if self.held:
            self._look_for_room()
            return self.held
        if self.start is None:
            wait = run_queue_wait_ns()
            if wait is not None:
                self.start = (time.perf_counter_ns(), wait)
        return False

    def after_step(self) -> None:
        """After a decode step that split: judge the watch so far."""
        if self.held or self.start is None:
            return
        wall0, wait0 = self.start
        wall = time.perf_counter_ns() - wall0
        if wall < MIN_WALL_NS:
            return
        wait = run_queue_wait_ns()
        if wait is not None and wait - wait0 > max(CROWDED_SHARE * wall, MIN_WAIT_NS):
            self.held, self.hold, self.room, self.start = True, self.next_hold, 0, None
            self.next_hold = min(2 * self.next_hold, MAX_HOLD)
        elif wall > 64 * MIN_WALL_NS:  # a long quiet watch: the crowd, if it comes, shows sooner in a fresh one
            self.start, self.next_hold = None, HOLD

    def _look_for_room(self) -> None:
        if self.hold > 0:
            self.hold -= 1
        others = others_running()
        spare = others is not None and others + self.threads <= usable_cpus()
        self.room = self.room + 1 if spare else 0
        if self.hold == 0 and self.room >= ROOM_STEPS:
            self.held = False
