"""A busy neighbour for benchmarks: a Python busy loop in another process, pinned to one core.

`hybridkv bench throughput --busy-neighbour` times the engine quiet and beside this loop. The
engine keeps to the cores the neighbour does not use (its affinity mask, which sizes torch's
thread pool, see worker/threads.py), as a process placed by `taskset` or a cpuset would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_LOOP = "while True:\n    pass\n"


def split_cores() -> tuple[set[int], int]:
    """(cores for the engine, the neighbour's core): the neighbour takes the last core of
    this process's affinity mask."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("--busy-neighbour needs CPU affinity (Linux sched_getaffinity)")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"--busy-neighbour needs at least 2 cores in this process's "
                         f"affinity mask, got {cores}")
    return set(cores[:-1]), cores[-1]


@contextmanager
def own_cores(cores: set[int]) -> Iterator[None]:
    """Run this process on `cores` only, then restore its mask."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextmanager
def busy_neighbour(core: int) -> Iterator[None]:
    """A process spinning in a Python loop on `core` while the block runs."""
    # A session of its own, as an unrelated program has: with the kernel's autogroup
    # scheduling, a child in our session would share our CPU weight instead of taking its own.
    proc = subprocess.Popen([sys.executable, "-c", _LOOP], start_new_session=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield
    finally:
        proc.kill()
        proc.wait()
