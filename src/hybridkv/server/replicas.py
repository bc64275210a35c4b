"""`hybridkv serve --data-parallel-size N`: N engine processes on disjoint cores, on N
consecutive ports, for an external router (smg, vllm-router, llm-d) in front of them.

    replica i: hybridkv serve ... --port PORT+i --replica-index i, its CPU affinity the
               i-th of N equal, disjoint slices of this process's cores

Every replica gets one block hash seed (the given one, else a fresh random one), so their
block hashes, KV events and shared tiers (`--kv-remote`, given to all) agree. The launcher
forwards SIGTERM/SIGINT to the replicas and waits for them; when one exits on its own, it
stops the others and exits with that replica's status.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def core_slices(cores: Sequence[int], num_replicas: int) -> list[list[int]]:
    """`num_replicas` disjoint, contiguous slices of `cores` (sorted), sizes differing by at
    most one. E.g. 10 cores, 3 replicas -> 4 + 3 + 3."""
    cores = sorted(cores)
    if num_replicas > len(cores):
        raise ValueError(f"--data-parallel-size {num_replicas} needs at least one core per "
                         f"replica; this process may run on {len(cores)} "
                         f"({', '.join(map(str, cores))})")
    base, extra = divmod(len(cores), num_replicas)
    out, start = [], 0
    for i in range(num_replicas):
        size = base + (i < extra)
        out.append(cores[start:start + size])
        start += size
    return out


def replica_argv(argv: Sequence[str], index: int, port: int) -> list[str]:
    """The `serve` arguments of one replica: the launcher's, less --data-parallel-size and
    --port, plus its own port and index."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--data-parallel-size", "--port", "--replica-index", "--data-parallel-rank"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return [*out, "--port", str(port), "--replica-index", str(index)]


def launch_replicas(argv: Sequence[str], *, num_replicas: int, port: int,
                    seed_env: str) -> int:
    """Run the replicas until they stop; returns the exit status."""
    if port and port + num_replicas - 1 > 65535:
        raise ValueError(f"--port {port} with --data-parallel-size {num_replicas} runs past "
                         f"port 65535")
    if port == 0:
        raise ValueError("--data-parallel-size needs a --port (replica i listens on PORT+i)")
    slices = core_slices(sorted(os.sched_getaffinity(0)), num_replicas)
    env = dict(os.environ)
    env[seed_env] = env.get(seed_env) or secrets.token_hex(32)
    procs: list[subprocess.Popen[bytes]] = []
    for rank, cores in enumerate(slices):
        cmd = [sys.executable, "-m", "hybridkv.cli", "serve",
               *replica_argv(argv, rank, port + rank)]

        def pin(cores: list[int] = cores) -> None:
            os.sched_setaffinity(0, cores)

        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=pin))  # noqa: PLW1509
        logger.info("replica %d: port %d, cores %s, pid %d", rank, port + rank,
                    ",".join(map(str, cores)), procs[-1].pid)

    stopping = False
    failed: int | None = None

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    while any(proc.poll() is None for proc in procs):
        ended = [proc for proc in procs if proc.poll() is not None]
        if ended and not stopping:
            # A replica stopped on its own: the router would send it nothing any more.
            failed = ended[0].returncode or 1
            logger.warning("replica pid %d exited with status %d: stopping the others",
                           ended[0].pid, ended[0].returncode)
            forward(signal.SIGTERM, None)
        time.sleep(0.2)
    if failed is None and not stopping:
        failed = next((p.returncode for p in procs if p.returncode), 0) or 1
    return failed or 0
