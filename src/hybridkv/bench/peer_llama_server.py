"""llama-server as a peer for benchmarks: started on a free loopback port with the given
flags, asked for greedy completions of token-id prompts over its HTTP API, stopped.

Its /completion answer carries its own timings (`predicted_per_second`: the tokens after
prompt processing over their time) and, with speculation, the drafts it made and kept
(`draft_n`, `draft_n_accepted`); `return_tokens` gives the token ids, so greedy outputs can
be compared without detokenizing. Standard library only (urllib): the peer is measured, not
our HTTP stack.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Completion:
    tokens: list[int]
    decode_tok_s: float  # llama-server's predicted_per_second
    num_draft_tokens: int
    num_accepted_tokens: int


class LlamaServer:
    """One llama-server process; use as a context manager."""

    def __init__(self, binary: Path, model: str, *, threads: int, ctx: int,
                 extra: list[str]) -> None:
        if not binary.is_file():
            raise ValueError(f"no llama-server at {binary}: run "
                             f"shared/bench/peer-llamacpp/setup.sh, or pass --llama-bin")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
        # One slot, no prompt cache reuse across requests: every request prefills its
        # prompt, as the hybridkv runs do (prefill is not what is compared).
        cmd = [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
               "--no-webui", *extra]
        # Its log goes to a file: a pipe nobody reads would fill and stall the server.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env, text=True)
        self._wait_healthy(" ".join(cmd))

    def _wait_healthy(self, cmd: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().strip()
                self.log.close()
                last = err.splitlines()[-1] if err else "no output"
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {last}; "
                                   f"command: {cmd}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not answer /health in {START_TIMEOUT_S:.0f} s")

    def complete(self, prompt: list[int], max_tokens: int) -> Completion:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
                "stream": False}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            out: dict[str, Any] = json.load(r)
        t = out.get("timings") or {}
        return Completion([int(x) for x in out.get("tokens") or []],
                          float(t.get("predicted_per_second") or 0.0),
                          int(t.get("draft_n") or 0), int(t.get("draft_n_accepted") or 0))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
