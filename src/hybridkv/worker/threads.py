"""How many intra-op threads torch uses, chosen on purpose rather than left to torch.

The default is the number of cores this process may run on (its CPU affinity mask, as
`taskset` or a container's cpuset sets it), not the machine's core count: an OpenMP thread
that shares a core with another busy process holds up every parallel region at its barrier,
so one thread too many costs far more than the core it was meant to add. An explicit
`OMP_NUM_THREADS` caps the default, as it caps torch's own.
"""

from __future__ import annotations

import os

import torch


def affinity_cores() -> int:
    """Cores in this process's CPU affinity mask (all cores where the OS has no masks)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return max(1, len(getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    cores = affinity_cores()
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return min(cores, int(omp))
    return cores


def set_intra_op_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to `threads` (None: `default_threads()`); returns the
    number set. Process-wide, like torch's own setting."""
    chosen = default_threads() if threads is None else threads
    if chosen < 1:
        raise ValueError(f"threads must be >= 1, got {chosen}")
    if torch.get_num_threads() != chosen:
        torch.set_num_threads(chosen)
    return chosen
