"""`hybridkv bench offload MODEL --remote redis://...`: two replicas sharing one Redis.

    replica 1   computes a fresh long prefix (+ a short suffix) and shares its blocks as
                they fill (store policy "fill"), then waits until Redis has them
    replica 2   an engine with an empty device cache and its own CPU tier, timed on
                    recompute  a prefix nowhere (another fresh one)
                    remote     replica 1's prefix: loaded from Redis (and copied into its
                               CPU tier on the way: promotion)
                    cpu        the same prefix again after dropping its device cache: from
                               its local CPU tier
    redis-benchmark  SET then GET of one value of a block's size, in the same run: what
                     this Redis serves a plain client, next to what the tier loads

Both replicas live in this process (two engines, two device caches, one Redis): what is
timed is replica 2's path, which is the same in a process of its own. Every output reports
where its hit came from (`cached_tokens_by_tier`), so a reader sees the remote case's tokens
really came from Redis.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import statistics
import subprocess
from typing import Any

from hybridkv.bench.offload import (
    GB,
    SUFFIX_TOKENS,
    PathTimer,
    _delta,
    _tier_stats,
    _timed_generate,
    _tokens,
    config_of,
    drop_device_cache,
    fit_kv_memory,
    kv_bytes,
)
from hybridkv.connector.offload.entry import HEADER
from hybridkv.connector.offload.redis_tier import RemoteSpec, parse_remote_url

CASES = ("recompute", "remote", "cpu")
BENCH_KEY = re.compile(rb"key:\d{12}")  # what redis-benchmark SETs and GETs with -r


def redis_benchmark_get(spec: RemoteSpec, value_bytes: int, keyspace: int
                        ) -> dict[str, Any] | None:
    """GET throughput of `redis-benchmark -t set,get -d value_bytes -r keyspace` with 50
    clients (its default) and with one pipelined client (what a load job is): requests/s and
    GB/s of values. `keyspace` as many keys as the prefix has blocks: without -r every GET
    reads one key, whose value stays in the server's CPU cache, which no prefix load does.
    None if redis-benchmark is not installed."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    requests = max(200, min(100_000, int(2e9 // value_bytes)))
    env = dict(os.environ)
    if spec.password:
        env["REDISCLI_AUTH"] = spec.password  # not on the command line (ps shows that)
    base = [binary, "-h", spec.host, "-p", str(spec.port), "--dbnum", str(spec.db),
            "-t", "set,get", "-d", str(value_bytes), "-n", str(requests), "--csv",
            "-r", str(keyspace)]
    if spec.username:
        base += ["--user", spec.username]
    if spec.scheme == "rediss":
        base.append("--tls")
    out: dict[str, Any] = {"value_bytes": value_bytes, "requests": requests,
                           "keyspace": keyspace}
    for name, extra in (("clients_50", ["-c", "50"]), ("pipelined_1", ["-c", "1", "-P", "64"])):
        rps, error = None, ""
        # A run that reports no GET row (seen once, in a full test run) is tried again
        # before it counts as missing; the last error line is kept beside it.
        for _ in range(3):
            done = subprocess.run(base + extra, capture_output=True, text=True, env=env,
                                  timeout=600, check=False)
            rps = _csv_rps(done.stdout, "GET")
            if rps is not None:
                break
            error = (done.stderr.strip() or done.stdout.strip() or
                     f"exit status {done.returncode}").splitlines()[-1]
        out[name] = {"get_per_s": rps, "gbps": rps * value_bytes / GB} if rps is not None \
            else None
        if rps is None:
            out[f"{name}_error"] = error
    _cleanup(spec)
    return out


def _csv_rps(text: str, test: str) -> float | None:
    for line in text.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) > 1 and cells[0] == test:
            try:
                return float(cells[1])
            except ValueError:
                return None
    return None


def _cleanup(spec: RemoteSpec) -> None:
    from hybridkv.connector.offload.redis_tier import make_client

    client = make_client(spec, 5.0)
    try:
        names = [n for n in client.scan_iter(match=b"key:*", count=1000)
                 if BENCH_KEY.fullmatch(n)]
        for start in range(0, len(names), 1000):
            client.delete(*names[start:start + 1000])
    finally:
        client.close()


def _remote_round(first: Any, second: Any, timer: PathTimer, rng: random.Random,
                  prefix_tokens: int, vocab: int) -> dict[str, Any]:
    def suffix() -> list[int]:
        return _tokens(rng, SUFFIX_TOKENS, vocab)

    prefix = _tokens(rng, prefix_tokens, vocab)
    _timed_generate(first, prefix + suffix())  # replica 1 computes and shares (flushed)
    seconds, by_tier, load = {}, {}, {}
    for case in CASES:
        if case == "cpu":
            drop_device_cache(second)
        prompt = (_tokens(rng, prefix_tokens, vocab) if case == "recompute" else prefix)
        before, load_start = _tier_stats(second), timer.load_s
        seconds[case], out = _timed_generate(second, prompt + suffix())
        by_tier[case] = dict(out.cached_tokens_by_tier)
        after = _tier_stats(second)
        if case != "recompute":
            load[case] = {"bytes": _delta(after, before, case, "bytes_loaded"),
                          "load_s": timer.load_s - load_start,
                          "read_s": _delta(after, before, case, "load_seconds")}
    return {"seconds": seconds, "by_tier": by_tier, "load": load}


def _gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / GB if nbytes and seconds > 0 else None


def bench_remote(model_dir: str, url: str, *, prefix_tokens: int, repeat: int,
                 seed: int) -> dict[str, Any]:
    from hybridkv import LLM
    from hybridkv.bench.engine import model_vocab

    spec = parse_remote_url(url, flag="--remote")
    max_model_len = prefix_tokens + SUFFIX_TOKENS + 16
    config = config_of(model_dir)
    prefix_bytes = kv_bytes(config, max_model_len, 4)
    memory, _ = fit_kv_memory(model_dir, 2 * prefix_bytes, max_model_len)
    common = dict(kv_cache_memory=memory, max_model_len=max_model_len,
                  allow_long_max_model_len=True, kv_remote=url, kv_offload_store="fill",
                  kv_remote_queue=max(256 << 20, 2 * prefix_bytes))
    vocab, rng = model_vocab(model_dir), random.Random(seed)
    first = LLM(model_dir, **common)
    second = LLM(model_dir, kv_offload_cpu=4 * prefix_bytes, **common)
    remote = second.engine.connector.chain.tiers[-1]
    try:
        if not remote.connected:
            raise ValueError(f"--remote: Redis at {spec.where} does not answer")
        timer = PathTimer(second.engine.runner.connector)
        _remote_round(first, second, timer, rng, min(prefix_tokens, 256), vocab)  # warm-up
        rounds = [_remote_round(first, second, timer, rng, prefix_tokens, vocab)
                  for _ in range(repeat)]
        stats = second.offload_stats()
    finally:
        remote.clear()  # the blocks of this run: nobody will ask for random tokens again
        first.close()
        second.close()
    block = max(g.block_bytes for g in config.groups)
    value_bytes = block + HEADER.size + 64  # header, layout fingerprint and key: ~0.1 KiB
    bench = redis_benchmark_get(spec, value_bytes, max(1, prefix_tokens // config.hash_block_size))
    return summarize(rounds, bench, stats, prefix_tokens=prefix_tokens, repeat=repeat,
                     memory=memory, block_bytes=block, where=spec.where)


def summarize(rounds: list[dict[str, Any]], bench: dict[str, Any] | None,
              stats: dict[str, Any] | None, **info: Any) -> dict[str, Any]:
    ttft = {c: statistics.median(r["seconds"][c] for r in rounds) for c in CASES}
    hits = {c: min(r["by_tier"][c].get(c, 0) for r in rounds) for c in ("remote", "cpu")}
    load = {}
    for case in ("remote", "cpu"):
        load[case] = {
            "load_gbps": statistics.median(
                _gbps(r["load"][case]["bytes"], r["load"][case]["load_s"]) or 0.0
                for r in rounds),
            "read_gbps": statistics.median(
                _gbps(r["load"][case]["bytes"], r["load"][case]["read_s"]) or 0.0
                for r in rounds),
            "bytes": statistics.median(r["load"][case]["bytes"] for r in rounds)}
    best = None
    if bench is not None:
        runs = [bench[k]["gbps"] for k in ("clients_50", "pipelined_1") if bench.get(k)]
        best = max(runs) if runs else None
    return {**info, "ttft_s": ttft,
            "ttft_each_s": {c: [r["seconds"][c] for r in rounds] for c in CASES},
            "hit_tokens": hits,
            "speedup": {"remote": ttft["recompute"] / ttft["remote"],
                        "cpu": ttft["recompute"] / ttft["cpu"]},
            "remote_vs_cpu": ttft["remote"] / ttft["cpu"],
            "load": load, "redis_benchmark": bench,
            "remote_load_fraction_of_redis_benchmark":
                load["remote"]["load_gbps"] / best if best else None,
            "offload_stats": stats}


def format_remote(f: dict[str, Any]) -> list[str]:
    ttft, hits, speedup = f["ttft_s"], f["hit_tokens"], f["speedup"]
    lines = [f"two replicas on {f['where']}: replica 2's TTFT on a {f['prefix_tokens']}-token "
             f"prefix replica 1 computed; medians of {f['repeat']}",
             f"{'TTFT':<10} {'seconds':>9} {'speedup':>8} {'hit tokens (that tier)':>23}",
             f"{'recompute':<10} {ttft['recompute']:9.3f}"]
    for case in ("remote", "cpu"):
        lines.append(f"{case:<10} {ttft[case]:9.3f} {speedup[case]:7.1f}x {hits[case]:>23}")
    load = f["load"]
    lines += ["", f"{'GB/s':<10} {'load job':>9} {'tier read':>10}"]
    for case in ("remote", "cpu"):
        lines.append(f"{case:<10} {load[case]['load_gbps']:9.2f} "
                     f"{load[case]['read_gbps']:10.2f}")
    bench = f["redis_benchmark"]
    if bench is None:
        lines.append("redis-benchmark: not installed")
    else:
        for name in ("clients_50", "pipelined_1"):
            run = bench.get(name)
            if run:
                lines.append(f"redis-benchmark GET {bench['value_bytes']} B of "
                             f"{bench['keyspace']} keys, {name}: "
                             f"{run['get_per_s']:.0f}/s = {run['gbps']:.2f} GB/s")
        fraction = f["remote_load_fraction_of_redis_benchmark"]
        if fraction is not None:
            lines.append(f"remote load job / best redis-benchmark GET: {fraction:.0%}")
    return lines
