"""Two hybridkv processes serving one GGUF file: how much memory they hold together.

Each process loads the model, generates a few tokens and stays up; with both alive, each
one's RSS and PSS (proportional set size: a page shared by two processes counts half in
each) come from /proc/PID/smaps_rollup. The figure users care about is the sum of the two
PSS over one process's RSS: 2.0 where every byte is private, near 1.0 where the weights are
one copy in the page cache (`bench gguf --two-processes`). Linux only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

_CHILD = textwrap.dedent("""
    import sys
    from hybridkv import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_model_len=1024, max_num_seqs=1, threads=int(sys.argv[2]))
    llm.generate([[5, 6, 7, 8, 9, 10, 11, 12]],
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    print("ready", flush=True)
    sys.stdin.readline()
""")


def _usage(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of process `pid` in MiB."""
    rss = pss = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss"):
            kib = int(rest.split()[0])
            rss, pss = (kib, pss) if name == "Rss" else (rss, kib)
    return rss / 1024, pss / 1024


def two_processes(path: str, threads: int, pin: str, env: dict[str, str]) -> dict[str, Any]:
    """Start two engines on `path` one after the other (the second finds the first's pages),
    pinned to `pin`; with both up, their RSS and PSS."""
    if not Path("/proc/self/smaps_rollup").exists():
        raise ValueError("--two-processes reads /proc/PID/smaps_rollup (Linux)")
    cores = {int(c) for c in pin.split(",")}
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(2):
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, path, str(threads)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                preexec_fn=lambda: os.sched_setaffinity(0, cores))
            procs.append(proc)
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a hybridkv process on {path} did not start "
                                   f"(exit {proc.wait()})")
        usage = [_usage(p.pid) for p in procs]
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=120)
    rss = [u[0] for u in usage]
    pss = [u[1] for u in usage]
    return {"rss_mib": [round(r, 1) for r in rss], "pss_mib": [round(p, 1) for p in pss],
            "pss_sum_over_rss": round(sum(pss) / max(rss), 3)}
