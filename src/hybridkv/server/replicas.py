"""`hybridkv serve --data-parallel-size N`: N engine processes on disjoint cores, on N
consecutive ports, for an external router (smg, vllm-router, llm-d) in front of them.

    replica i: hybridkv serve ... --port PORT+i --replica-index i, its CPU affinity the
               i-th of N equal, disjoint slices of this process's cores

Every replica gets one block hash seed (the given one, else a fresh random one), so their
block hashes, KV events and shared tiers (`--kv-remote`, given to all) agree. The launcher
forwards SIGTERM/SIGINT to the replicas and waits for them.

Replicas survive each other: one that dies after it served is logged and started again on
its port and cores (`RestartPolicy`: a back-off doubling with each death in a row, and left
out after too many), while the others keep serving. One that fails before it ever served is
a start-up failure (a bad option, a port in use: every replica would fail alike), so the
launcher stops the others and exits with its status. The launcher keeps each replica's state
in a JSON file (`$HYBRIDKV_REPLICA_STATUS`, given to the replicas) that every replica's
`/metrics` reports, so any survivor's scrape shows which replica is down and how often each
was restarted.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

REPLICA_STATUS_ENV = "HYBRIDKV_REPLICA_STATUS"
POLL_S = 0.2  # how often the launcher looks at its replicas


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


@dataclass
class RestartPolicy:
    """When a dead replica starts again. Deaths in a row double the wait (1 s, 2 s, 4 s, ...
    at most `backoff_max_s`); a replica that served `stable_s` before dying starts the count
    afresh, so one crash a day is restarted at once for ever, while a replica that crashes
    as it comes up is left out after `max_restarts` tries instead of looping."""

    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0
    max_restarts: int = 5
    deaths_in_a_row: int = 0

    def died(self, served_s: float | None) -> float | None:
        """The wait before the next start (None: leave the replica out), for a death after
        `served_s` seconds of serving (None: it never answered /health)."""
        if served_s is not None and served_s >= self.stable_s:
            self.deaths_in_a_row = 0
        self.deaths_in_a_row += 1
        if self.deaths_in_a_row > self.max_restarts:
            return None
        return min(self.backoff_s * 2.0 ** (self.deaths_in_a_row - 1), self.backoff_max_s)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def probe_host(host: str) -> str:
    """Where the launcher reaches a replica listening on `host`."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def answers_health(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return False


@dataclass
class Replica:
    index: int
    port: int
    cores: list[int]
    policy: RestartPolicy
    proc: subprocess.Popen[bytes] | None = None
    up_since: float | None = None  # when this start first answered /health
    ever_served: bool = False
    restarts: int = 0
    restart_at: float | None = None
    left_out: bool = False
    last_exit: str | None = None

    @property
    def state(self) -> str:
        if self.left_out:
            return "left_out"
        if self.proc is None:
            return "restarting" if self.restart_at is not None else "stopped"
        return "serving" if self.up_since is not None else "starting"

    def status(self) -> dict[str, Any]:
        return {"replica": self.index, "port": self.port, "state": self.state,
                "pid": self.proc.pid if self.proc is not None else None,
                "restarts": self.restarts, "last_exit": self.last_exit}


def write_status(path: str, replicas: Sequence[Replica]) -> None:
    """Atomically: a replica's scrape never reads half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"replicas": [r.status() for r in replicas]}, f)
    os.replace(tmp, path)


def read_status(path: str) -> list[dict[str, Any]]:
    """The launcher's view of its replicas ([] if the file is gone or unreadable)."""
    try:
        with open(path) as f:
            replicas = json.load(f)["replicas"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return replicas if isinstance(replicas, list) else []


def launch_replicas(argv: Sequence[str], *, num_replicas: int, port: int, seed_env: str,
                    host: str = "127.0.0.1",
                    policy: Callable[[], RestartPolicy] = RestartPolicy) -> int:
    """Run the replicas until they stop; returns the exit status."""
    if port and port + num_replicas - 1 > 65535:
        raise ValueError(f"--port {port} with --data-parallel-size {num_replicas} runs past "
                         f"port 65535")
    if port == 0:
        raise ValueError("--data-parallel-size needs a --port (replica i listens on PORT+i)")
    slices = core_slices(sorted(os.sched_getaffinity(0)), num_replicas)
    env = dict(os.environ)
    env[seed_env] = env.get(seed_env) or secrets.token_hex(32)
    status_dir = tempfile.mkdtemp(prefix="hybridkv-replicas-")
    status_path = env[REPLICA_STATUS_ENV] = os.path.join(status_dir, "status.json")
    replicas = [Replica(rank, port + rank, cores, policy())
                for rank, cores in enumerate(slices)]
    where = probe_host(host)

    def start(replica: Replica) -> None:
        cmd = [sys.executable, "-m", "hybridkv.cli", "serve",
               *replica_argv(argv, replica.index, replica.port)]

        def pin(cores: list[int] = replica.cores) -> None:
            os.sched_setaffinity(0, cores)

        replica.proc = subprocess.Popen(cmd, env=env, preexec_fn=pin)  # noqa: PLW1509
        replica.up_since = replica.restart_at = None
        logger.info("replica %d: port %d, cores %s, pid %d", replica.index, replica.port,
                    ",".join(map(str, replica.cores)), replica.proc.pid)

    stopping = False
    failed: int | None = None

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for r in replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signum)

    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, forward)
        for replica in replicas:
            start(replica)
        write_status(status_path, replicas)
        while True:
            now, changed = time.monotonic(), False
            for r in replicas:
                if r.proc is None:
                    if not stopping and r.restart_at is not None and now >= r.restart_at:
                        r.restarts += 1
                        start(r)
                        changed = True
                    continue
                code = r.proc.poll()
                if code is None:
                    if r.up_since is None and not stopping and answers_health(where, r.port):
                        r.up_since, r.ever_served, changed = now, True, True
                        if r.restarts:
                            logger.warning("replica %d: serving again on port %d (restart "
                                           "%d)", r.index, r.port, r.restarts)
                    continue
                pid, r.proc, r.last_exit, changed = r.proc.pid, None, describe_exit(code), True
                if stopping:
                    continue
                if not r.ever_served:
                    logger.error("replica %d (port %d, pid %d) ended before it served (%s): "
                                 "stopping the others", r.index, r.port, pid, r.last_exit)
                    failed = code if code > 0 else 1
                    forward(signal.SIGTERM, None)
                    continue
                wait = r.policy.died(None if r.up_since is None else now - r.up_since)
                if wait is None:
                    r.left_out = True
                    logger.error("replica %d (port %d, pid %d) died (%s), %d times in a row "
                                 "without serving %g s: left out; the others keep serving",
                                 r.index, r.port, pid, r.last_exit, r.policy.deaths_in_a_row,
                                 r.policy.stable_s)
                else:
                    r.restart_at = now + wait
                    logger.warning("replica %d (port %d, pid %d) died (%s): restarting it in "
                                   "%g s; the others keep serving", r.index, r.port, pid,
                                   r.last_exit, wait)
            if changed:
                write_status(status_path, replicas)
            if all(r.proc is None for r in replicas) and (
                    stopping or all(r.left_out for r in replicas)):
                break
            time.sleep(POLL_S)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    if failed is not None:
        return failed
    return 0 if stopping else 1  # every replica left out
