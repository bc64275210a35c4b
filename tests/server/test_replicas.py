"""`hybridkv serve --data-parallel-size 2` as a user runs it: replica processes on free
consecutive loopback ports, stopped by SIGTERM with status 0. A replica killed with SIGKILL
is reported (the launcher's log line, every replica's /metrics) and restarted on its port
while the other keeps answering; a replica that fails before it ever served stops the
launcher at once with its one-line error; and the restart policy backs off, then leaves out
a replica that keeps dying."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hybridkv.server.replicas import RestartPolicy, describe_exit
from tests.connector.vllm_events import free_port_pair
from tests.server.conftest import LiveServer


def completion(url: str) -> int:
    return httpx.post(f"{url}/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 2,
                                                     "temperature": 0}, timeout=30).status_code


def wait_until(check, what: str, proc: subprocess.Popen[bytes], log: Path,
               timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the launcher exited: {log.read_text()[-3000:]}"
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what}: {log.read_text()[-3000:]}"
        time.sleep(0.1)


def replica_series(replica: LiveServer, name: str, index: int) -> float | None:
    return replica.metrics().get(f"hybridkv:data_parallel_replica_{name}{{replica={index}}}")


def test_a_killed_replica_is_reported_and_restarted_while_the_other_serves(
        demo_dir: Path, tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--data-parallel-size 2 needs 2 cores")
    port = free_port_pair()
    log = tmp_path / "launcher.log"
    with log.open("wb") as out:
        # --log-level info: the launcher logs each replica's pid.
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridkv.cli", "serve", str(demo_dir), "--port", str(port),
             "--data-parallel-size", "2", "--kv-cache-memory", "8MiB", "--max-model-len",
             "256", "--log-level", "info"],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT)
    doomed, survivor = (LiveServer(f"http://127.0.0.1:{port + i}", None) for i in range(2))
    try:
        # Replica i answers on PORT+i, and every replica's /metrics sees both serving.
        for replica in (doomed, survivor):
            wait_until(lambda r=replica: completion(r.url) == 200,
                       f"{replica.url} never answered", proc, log)
        wait_until(lambda: all(replica_series(doomed, "up", i) == 1.0 for i in (0, 1)),
                   "the replicas were never both reported serving", proc, log, timeout=10)
        [pid] = re.findall(rf"replica 0: port {port}, cores [\d,]+, pid (\d+)", log.read_text())
        os.kill(int(pid), signal.SIGKILL)

        # The survivor answers at once, and its /metrics reports replica 0 down.
        assert completion(survivor.url) == 200
        wait_until(lambda: replica_series(survivor, "up", 0) == 0.0,
                   "the survivor never reported replica 0 down", proc, log, timeout=10)
        assert completion(survivor.url) == 200
        # The launcher said why, and started replica 0 again on its port.
        wait_until(lambda: "replica 0 " in log.read_text() and "died (killed by SIGKILL)"
                   in log.read_text(), "no line about the death", proc, log, timeout=10)
        wait_until(lambda: completion(doomed.url) == 200, "replica 0 never answered again",
                   proc, log)
        assert replica_series(doomed, "restarts_total", 0) == 1.0
        assert replica_series(survivor, "restarts_total", 1) == 0.0
        wait_until(lambda: replica_series(survivor, "up", 0) == 1.0,
                   "the restarted replica never reported serving", proc, log, timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text


def test_a_replica_that_fails_before_serving_stops_the_launcher_in_one_line(
        demo_dir: Path) -> None:
    """Not restarted: every replica would fail alike (here: a state dtype on a model without
    states, which only the model's layers tell)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--data-parallel-size 2 needs 2 cores")
    r = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "serve", str(demo_dir), "--port",
         str(free_port_pair()), "--data-parallel-size", "2", "--kv-cache-memory", "8MiB",
         "--state-dtype", "bf16", "--log-level", "warning"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert "state_dtype (--state-dtype) 'bf16'" in r.stderr and "has none" in r.stderr
    assert "ended before it served (exit status 2): stopping the others" in r.stderr
    assert "Traceback" not in r.stderr and "restarting" not in r.stderr


def test_restarts_back_off_then_leave_a_replica_out() -> None:
    policy = RestartPolicy()
    # Dying as it comes up: 1, 2, 4, 8, 16 s, then left out rather than looping.
    assert [policy.died(None) for _ in range(6)] == [1, 2, 4, 8, 16, None]
    policy = RestartPolicy(backoff_max_s=3)
    assert [policy.died(5.0) for _ in range(4)] == [1, 2, 3, 3]  # capped
    # A replica that served a while before dying starts the count afresh: restarted at once
    # however many times that happens.
    assert all(policy.died(policy.stable_s) == 1 for _ in range(10))
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit status 3"
