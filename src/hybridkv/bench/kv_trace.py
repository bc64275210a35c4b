"""`hybridkv bench kv`: the KV manager trace of shared/bench/kv-trace.md, replayed lockstep.

The trace and the schedule follow that definition exactly, so figures compare call for call
with other managers timed on it (vLLM's reference figures live in that file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import struct
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from hybridkv.cli import Command, memory, positive_int
from hybridkv.kv.hashing import hash_cost_per_block
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.plan import KVCacheConfig, plan_kv_cache
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

VOCAB = 32000
MASK64 = (1 << 64) - 1
BLOCK_SIZE = 16
# One layer's page: 16 tokens x K,V x 8 heads x 128 x bf16 = 64 KiB.
PAGE_BYTES = 16 * 2 * 8 * 128 * 2
DEFAULT_MEMORY = 20_000 * 4 * PAGE_BYTES  # 20,000 four-layer blocks
CHECKSUMS = {(0, 512, 2048): "f1fe8e62b99b818d", (0, 32, 2048): "d8766b41f1e3653f"}


def splitmix64(seed: int) -> Iterator[int]:
    state = seed & MASK64
    while True:
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        yield z ^ (z >> 31)


def make_trace(seed: int = 0, num_requests: int = 512, shared_len: int = 2048,
               max_len: int = 8192) -> tuple[list[list[int]], str]:
    """The trace's prompts and checksum, drawn exactly as kv-trace.md defines them."""
    rng = splitmix64(seed)

    def uniform(lo: int, hi: int) -> int:
        return lo + next(rng) % (hi - lo + 1)

    prefix = [uniform(1, VOCAB - 1) for _ in range(shared_len)]
    prompts = []
    for i in range(num_requests):
        if shared_len > 0 and i % 2 == 0:
            length = uniform(shared_len + 512, max_len)
            prompts.append(prefix + [uniform(1, VOCAB - 1) for _ in range(length - shared_len)])
        else:
            length = uniform(1024, max_len)
            prompts.append([uniform(1, VOCAB - 1) for _ in range(length)])
    return prompts, trace_checksum(prompts)


def trace_checksum(prompts: list[list[int]]) -> str:
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(struct.pack("<I", len(prompt)))
        digest.update(struct.pack(f"<{len(prompt)}I", *prompt))
    return digest.hexdigest()[:16]


def read_trace(path: Path) -> tuple[list[list[int]], str]:
    """Prompts from a file written by make_kv_trace.py (its outputs follow the formula)."""
    prompts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                prompts.append([int(t) for t in json.loads(line)["prompt"]])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}, line {number}: expected a JSON object with a "
                                 f"\"prompt\" list of token ids") from None
    return prompts, trace_checksum(prompts)


def output_token(i: int, k: int) -> int:
    return 1 + (i * 131 + k * 7) % (VOCAB - 1)


def layer_specs(config: str) -> dict[str, KVCacheSpec]:
    attn = dict(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype="bf16")
    if config == "full":
        return {f"layer.{i}": FullAttentionSpec(**attn) for i in range(12)}
    if config == "hybrid":
        specs: dict[str, KVCacheSpec] = {}
        for i in range(4):
            specs[f"full.{i}"] = FullAttentionSpec(**attn)
            specs[f"swa512.{i}"] = SlidingWindowSpec(sliding_window=512, **attn)
            specs[f"swa4096.{i}"] = SlidingWindowSpec(sliding_window=4096, **attn)
        return specs
    raise ValueError(f"unknown bench configuration {config!r}; accepted: hybrid, full")


def kv_config(config: str, memory_bytes: int) -> KVCacheConfig:
    specs = layer_specs(config)
    plan = plan_kv_cache(specs, memory_bytes, max_model_len=1 << 20,
                         max_num_batched_tokens=8192, strict=False)
    return plan.config


@dataclass
class KVBenchResult:
    wall_s: float
    allocate_slots_us: float
    allocate_slots_decode_us: float
    allocate_slots_admit_us: float
    get_computed_blocks_us: float
    free_us: float
    hit_tokens: int
    queried_tokens: int
    peak_used_bytes: int
    steps: int
    preemptions: int


class _Req(KVRequest):
    index = 0
    num_outputs = 0


def run_kv_trace(prompts: list[list[int]], config: KVCacheConfig, *, decode_tokens: int = 128,
                 max_running: int = 256) -> KVBenchResult:
    """Replay the lockstep schedule of kv-trace.md against a fresh KVCacheManager."""
    manager = KVCacheManager(config, max_model_len=1 << 20)
    requests = []
    for i, prompt in enumerate(prompts):  # hashing the prompts is not timed, as in vLLM
        req = _Req(str(i), prompt, hash_block_size=config.hash_block_size)
        req.index, req.num_outputs = i, 0
        requests.append(req)
    waiting: deque[_Req] = deque(requests)
    running: list[_Req] = []
    decode_s = admit_s = gcb_s = free_s = 0.0
    num_decode = num_admit = num_gcb = num_free = 0
    hit_tokens = queried_tokens = preemptions = steps = peak_used = 0
    block_bytes = [g.block_bytes for g in config.groups]
    clock = time.perf_counter
    allocate_slots, get_computed_blocks, free = (
        manager.allocate_slots, manager.get_computed_blocks, manager.free)

    start = clock()
    while waiting or running:
        steps += 1
        manager.new_step_starts()
        scheduled: dict[_Req, int] = {}
        preempted: set[_Req] = set()
        for req in list(running):
            if req in preempted:
                continue  # preempted earlier in this step
            while True:
                t0 = clock()
                new = allocate_slots(req, 1)
                decode_s += clock() - t0
                num_decode += 1
                if new is not None:
                    scheduled[req] = 1
                    break
                victim = running.pop()
                t0 = clock()
                free(victim)
                free_s += clock() - t0
                num_free += 1
                victim.num_computed_tokens = 0
                scheduled.pop(victim, None)
                waiting.appendleft(victim)
                preemptions += 1
                preempted.add(victim)
                if victim is req:
                    break
        if not preempted:
            while waiting and len(running) < max_running:
                req = waiting[0]
                t0 = clock()
                blocks, hit = get_computed_blocks(req)
                t1 = clock()
                new = allocate_slots(req, req.num_tokens - hit, hit, blocks)
                admit_s += clock() - t1
                gcb_s += t1 - t0
                num_gcb += 1
                num_admit += 1
                if new is None:
                    if not running:
                        raise ValueError(
                            f"request {req.request_id} ({req.num_tokens} tokens) does not fit "
                            f"in an empty KV cache; raise --memory")
                    break
                waiting.popleft()
                running.append(req)
                scheduled[req] = req.num_tokens - hit
                queried_tokens += req.num_tokens
                hit_tokens += hit
        peak_used = max(peak_used, sum(gs.num_used * b for gs, b in
                                       zip(manager.pool.groups, block_bytes, strict=True)))
        finished = []
        for req, num in scheduled.items():
            req.num_computed_tokens += num
            req.append_token_ids((output_token(req.index, req.num_outputs),))
            req.num_outputs += 1
            if req.num_outputs == decode_tokens:
                finished.append(req)
        for req in finished:
            t0 = clock()
            free(req)
            free_s += clock() - t0
            num_free += 1
            running.remove(req)
    wall = clock() - start
    manager.check_integrity()
    return KVBenchResult(
        wall_s=wall,
        allocate_slots_us=(decode_s + admit_s) / max(1, num_decode + num_admit) * 1e6,
        allocate_slots_decode_us=decode_s / max(1, num_decode) * 1e6,
        allocate_slots_admit_us=admit_s / max(1, num_admit) * 1e6,
        get_computed_blocks_us=gcb_s / max(1, num_gcb) * 1e6,
        free_us=free_s / max(1, num_free) * 1e6,
        hit_tokens=hit_tokens, queried_tokens=queried_tokens, peak_used_bytes=peak_used,
        steps=steps, preemptions=preemptions)


def median_result(results: list[KVBenchResult]) -> KVBenchResult:
    """Each figure's median over repeated runs (counts are identical run to run)."""
    rows = [asdict(r) for r in results]
    return KVBenchResult(**{key: statistics.median(row[key] for row in rows)
                            for key in rows[0]})


def bench_kv(configs: list[str], *, memory_bytes: int = DEFAULT_MEMORY,
             num_requests: int = 512, trace_file: Path | None = None,
             repeat: int = 1, as_json: bool = False, hash_cost: bool = False) -> str:
    if trace_file is not None:
        prompts, checksum = read_trace(trace_file)
    else:
        prompts, checksum = make_trace(num_requests=num_requests)
    expected = CHECKSUMS.get((0, len(prompts), 2048))
    if expected is not None and checksum != expected:
        raise ValueError(f"trace checksum {checksum} != {expected}: the trace differs from "
                         f"kv-trace.md")
    results = {}
    for name in configs:
        config = kv_config(name, memory_bytes)
        results[name] = median_result([run_kv_trace(prompts, config) for _ in range(repeat)])
    # What keyed block hashes cost per algorithm (the trace itself runs with xxh3).
    extra = {"hash_us_per_block": hash_cost_per_block(block_size=16)} if hash_cost else {}
    if as_json:
        if len(results) == 1:
            return json.dumps({**asdict(next(iter(results.values()))), **extra})
        return json.dumps({**{name: asdict(r) for name, r in results.items()}, **extra})
    lines = [f"trace: {len(prompts)} requests, checksum {checksum}, memory {memory_bytes} bytes"
             + (f", medians of {repeat} runs" if repeat > 1 else ""),
             f"{'config':8} {'wall s':>7} {'alloc us':>9} {'decode':>7} {'admit':>8} "
             f"{'gcb us':>7} {'free us':>8} {'hit / queried tokens':>24} {'peak GiB':>9} "
             f"{'steps':>6} {'preempt':>7}"]
    for name, r in results.items():
        lines.append(
            f"{name:8} {r.wall_s:7.2f} {r.allocate_slots_us:9.1f} "
            f"{r.allocate_slots_decode_us:7.1f} {r.allocate_slots_admit_us:8.1f} "
            f"{r.get_computed_blocks_us:7.1f} {r.free_us:8.1f} "
            f"{f'{r.hit_tokens} / {r.queried_tokens}':>24} "
            f"{r.peak_used_bytes / (1 << 30):9.2f} {r.steps:6d} {r.preemptions:7d}")
    if extra:
        lines.append("block hash, us per 16-token block: " + ", ".join(
            f"{algo} {us:.2f}" for algo, us in extra["hash_us_per_block"].items()))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", choices=["hybrid", "full", "both"], default="both",
                        help="hybrid: 4 full + 4 SWA-512 + 4 SWA-4096 layers; full: 12 full")
    parser.add_argument("--memory", type=memory, default=None,
                        help="byte budget (default: 20,000 four-layer 64 KiB blocks)")
    parser.add_argument("--num-requests", type=positive_int, default=512,
                        help="requests in the generated trace")
    parser.add_argument("--trace", type=Path, default=None,
                        help="a trace file written by make_kv_trace.py (default: generate it)")
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="run N times and report the median of each figure")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--hash-cost", action="store_true",
                        help="also time one block hash with xxh3 and with sha256 "
                             "(hash_us_per_block in --json)")


def run(args: argparse.Namespace) -> int:
    configs = ["hybrid", "full"] if args.config == "both" else [args.config]
    print(bench_kv(configs, memory_bytes=args.memory or DEFAULT_MEMORY,
                   num_requests=args.num_requests, trace_file=args.trace,
                   repeat=args.repeat, as_json=args.json, hash_cost=args.hash_cost))
    return 0


COMMAND = Command("kv", "the KV manager trace of shared/bench/kv-trace.md", add_arguments, run)
