"""`hybridkv bench offload MODEL`: what KV offloading buys, figures printed.

    ttft       a long prefix of random tokens + a short suffix, one output token: time to
               first token with the prefix nowhere (recompute), in the device prefix cache,
               only in the CPU tier, only in the disk tier (the hit tokens per tier of each
               output show where it really came from)
    bandwidth  bytes per second through the load and store paths of each tier, next to a
               plain torch copy of as many bytes on this machine
    chat       (--chat) conversations x turns, round robin, their KV ~4x the device KV cache:
               tokens prefilled, throughput and tier traffic with offloading off, a CPU tier
               (store policies evict and fill), and a small CPU tier over a disk tier
    remote     (--remote redis://...) instead of the above: a second replica's TTFT on a
               prefix the first stored in Redis, against recompute and its own CPU tier,
               and the load bandwidth against redis-benchmark (bench/offload_remote.py)

Every case of one repeat uses a fresh prefix and each request its own suffix, so only the
prefix can hit. A disk tier's files are read back soon after they were written, from the page
cache unless `--cold-disk` drops them from it first.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.bench.engine import model_vocab
from hybridkv.cli import Command, offload_block_bytes, positive_int, remote_url
from hybridkv.cli import seed as seed_number
from hybridkv.connector.offload.store import parse_tier_spec
from hybridkv.kv.plan import KVCacheConfig, format_bytes, plan_kv_cache
from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config

CASES = ("recompute", "device", "cpu", "disk")
TIERS = ("cpu", "disk")
SUFFIX_TOKENS = 8
GB = 1e9


# ---------------------------------------------------------------- sizes from the plan

def fit_kv_memory(model_dir: str, want_bytes: float,
                  max_model_len: int) -> tuple[int, KVCacheConfig]:
    """The smallest KV budget >= `want_bytes` (in steps of 1.25x) the planner accepts for one
    request of `max_model_len`, and its plan's groups. Torch-free: the engine's own plan."""
    specs = kv_layout_from_config(load_hf_config(model_dir)).layer_specs
    memory = max(int(want_bytes), 1)
    for _ in range(200):
        try:
            plan = plan_kv_cache(specs, memory, max_model_len=max_model_len,
                                 max_num_batched_tokens=2048)
        except ValueError:
            memory = memory * 5 // 4 + 1
            continue
        return memory, plan.config
    raise ValueError(f"{model_dir}: no KV budget up to {format_bytes(memory)} fits one "
                     f"request of {max_model_len} tokens")


def kv_bytes(config: KVCacheConfig, tokens: int, checkpoints: int = 0) -> int:
    """What `tokens` prompt tokens and `checkpoints` state checkpoints take in a tier."""
    per_token, state = offload_block_bytes(config)
    return int(tokens * per_token) + checkpoints * state


# ---------------------------------------------------------------- helpers

def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


def _tier_stats(llm: Any) -> dict[str, dict[str, Any]]:
    stats = llm.offload_stats() or {"tiers": []}
    return {t["tier"]: t for t in stats["tiers"]}


def _delta(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]], tier: str,
           field: str) -> float:
    return float(after[tier][field] - before[tier][field]) if tier in after else 0.0


class PathTimer:
    """Wall time of the worker half's arena copies. The engine's tier stats time only the
    tiers' get/put (for the CPU tier a dict lookup that hands over a reference: no copy), and
    the load jobs' own wall time (`LoadDone.seconds`) is not kept; so the two methods that
    copy between the arena and host buffers are timed here, around the instance."""

    def __init__(self, worker: Any) -> None:
        self.load_s = 0.0  # load jobs: tier read + copy into the arena (background thread)
        self.copy_out_s = 0.0  # store copies: arena -> host buffers (the engine's thread)
        worker._load = self._timed(worker._load, "load_s")
        worker._copy_out = self._timed(worker._copy_out, "copy_out_s")

    def _timed(self, method: Callable[..., None], attr: str) -> Callable[..., None]:
        def run(*args: Any) -> None:
            start = time.perf_counter()
            try:
                method(*args)
            finally:
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - start)

        return run


def drop_device_cache(llm: Any) -> None:
    """Forget the device prefix cache with its blocks safely in the tiers: under the evict
    policy the reset only logs the evicted blocks; the next step copies them out (an empty
    step does), then the flush waits for the tier writes."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("the device prefix cache could not be reset (requests running)")
    llm.engine.step()
    llm.engine.runner.connector.flush()


def drop_page_cache(directory: str) -> None:
    """Write the disk tier's files out and ask the kernel to drop them from the page cache
    (advice: a filesystem may keep them), so that a load reads the disk."""
    for path in Path(directory).glob("*.kv"):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_copy_gbps(nbytes: int, device: Any, repeat: int = 5) -> dict[str, float]:
    """GB/s of one `dst.copy_(src)` of `nbytes` int8, host -> `device` (what a load does) and
    `device` -> host (a store), median of `repeat` after a warm-up copy."""
    import torch

    host = torch.ones(nbytes, dtype=torch.int8)
    dev = torch.zeros(nbytes, dtype=torch.int8, device=device)
    sync = torch.cuda.synchronize if dev.is_cuda else (lambda: None)
    out = {}
    for name, dst, src in (("load", dev, host), ("store", host, dev)):
        dst.copy_(src)
        times = []
        for _ in range(repeat):
            sync()
            start = time.perf_counter()
            dst.copy_(src)
            sync()
            times.append(time.perf_counter() - start)
        out[name] = nbytes / statistics.median(times) / GB
    return out


# ---------------------------------------------------------------- TTFT and bandwidth

def _timed_generate(llm: Any, prompt: list[int]) -> tuple[float, Any]:
    from hybridkv import SamplingParams

    start = time.perf_counter()
    [out] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    seconds = time.perf_counter() - start
    llm.engine.runner.connector.flush()  # tier writes off the next measurement's clock
    return seconds, out


def ttft_round(llm: Any, prefix: list[int], suffix: Callable[[], list[int]], timer: PathTimer,
               cold_disk: bool) -> dict[str, Any]:
    """One repeat of the four cases on a fresh `prefix`: seconds, cached tokens by tier, and
    the bytes and seconds of the load and store paths."""
    chain = llm.engine.connector.chain
    disk_dir = parse_tier_spec(llm.engine.config.kv_offload_disk).path
    seconds, by_tier, loads, store = {}, {}, {}, {}
    before_store, copy_out_start = _tier_stats(llm), timer.copy_out_s
    for case in CASES:
        if case in TIERS:
            drop_device_cache(llm)
        if case == "cpu":  # the stores of both policies are done by now
            stored = _tier_stats(llm)
            store = {t: (_delta(stored, before_store, t, "bytes_stored"),
                         timer.copy_out_s - copy_out_start
                         + _delta(stored, before_store, t, "store_seconds")) for t in TIERS}
        if case == "disk":
            chain.clear(chain.names.index("cpu"))
            if cold_disk:
                drop_page_cache(disk_dir)
        before, load_start = _tier_stats(llm), timer.load_s
        seconds[case], out = _timed_generate(llm, prefix + suffix())
        by_tier[case] = dict(out.cached_tokens_by_tier)
        if case in TIERS:
            loads[case] = (_delta(_tier_stats(llm), before, case, "bytes_loaded"),
                           timer.load_s - load_start)
    return {"seconds": seconds, "by_tier": by_tier, "loads": loads, "stores": store}


def _gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / GB if nbytes and seconds > 0 else None


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarize_ttft(rounds: list[dict[str, Any]], plain: dict[str, float]) -> dict[str, Any]:
    ttft = {case: statistics.median(r["seconds"][case] for r in rounds) for case in CASES}
    # The tokens each case's request found in the tier the case is about (the weakest
    # repeat): a reader sees the cpu case's hit came from the CPU tier, and so on.
    hit_tokens = {case: min(r["by_tier"][case].get(case, 0) for r in rounds)
                  for case in ("device", *TIERS)}
    hit_tokens["recompute"] = max(sum(r["by_tier"]["recompute"].values()) for r in rounds)
    bandwidth: dict[str, Any] = {"plain_copy": plain}
    for tier in TIERS:
        load = _median([_gbps(*r["loads"][tier]) for r in rounds])
        store = _median([_gbps(*r["stores"][tier]) for r in rounds])
        # The load path end to end: what the request waited beyond a device hit.
        effective = _median([_gbps(r["loads"][tier][0],
                                   r["seconds"][tier] - r["seconds"]["device"])
                             for r in rounds])
        bandwidth[tier] = {
            "load": load, "store": store, "effective_load": effective,
            "load_fraction": load / plain["load"] if load else None,
            "store_fraction": store / plain["store"] if store else None,
            "bytes_loaded": _median([r["loads"][tier][0] for r in rounds]),
            "bytes_stored": _median([r["stores"][tier][0] for r in rounds])}
    # The fastest repeat too: on a shared machine the median can still carry another
    # process's burst.
    each = {case: [r["seconds"][case] for r in rounds] for case in CASES}
    return {"ttft_s": ttft, "ttft_min_s": {case: min(each[case]) for case in CASES},
            "ttft_each_s": each, "hit_tokens": hit_tokens,
            "speedup": {t: ttft["recompute"] / ttft[t] for t in ("device", *TIERS)},
            "cached_tokens_by_tier": rounds[-1]["by_tier"], "bandwidth_gbps": bandwidth}


def bench_ttft(model_dir: str, *, prefix_tokens: int, repeat: int, store: str,
               disk_root: str | None, cold_disk: bool, seed: int) -> dict[str, Any]:
    from hybridkv import LLM

    max_model_len = prefix_tokens + SUFFIX_TOKENS + 16
    prefix_bytes = kv_bytes(config_of(model_dir), max_model_len, 4)
    # Room for the cached prefix and a second request reading it.
    memory, _ = fit_kv_memory(model_dir, 2 * prefix_bytes, max_model_len)
    vocab, rng = model_vocab(model_dir), random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="hybridkv-offload-", dir=disk_root) as disk:
        # A random model's positions past its training length cost the same: allowed.
        llm = LLM(model_dir, kv_cache_memory=memory, max_model_len=max_model_len,
                  allow_long_max_model_len=True, kv_offload_store=store,
                  kv_offload_cpu=2 * prefix_bytes,
                  kv_offload_disk=f"{disk}:{3 * prefix_bytes + (8 << 20)}")
        try:
            timer = PathTimer(llm.engine.runner.connector)
            plain = plain_copy_gbps(prefix_bytes, llm.engine.runner.arena.device)

            def suffix() -> list[int]:
                return _tokens(rng, SUFFIX_TOKENS, vocab)

            # Warm up every path on a short prefix (the first calls pay one-time costs).
            ttft_round(llm, _tokens(rng, min(prefix_tokens, 256), vocab), suffix, timer,
                       cold_disk)
            rounds = [ttft_round(llm, _tokens(rng, prefix_tokens, vocab), suffix, timer,
                                 cold_disk) for _ in range(repeat)]
            figures = summarize_ttft(rounds, plain)
            figures["kv_cache_memory"] = memory
            figures["offload_stats"] = llm.offload_stats()
            figures["device"] = str(llm.engine.runner.arena.device)
        finally:
            llm.close()
    return figures


def config_of(model_dir: str) -> KVCacheConfig:
    """The model's KV groups (a plan at a roomy budget: only the groups' shapes are used)."""
    return fit_kv_memory(model_dir, 1 << 30, 16)[1]


# ---------------------------------------------------------------- the chat trace

@dataclass(frozen=True)
class ChatTrace:
    """Conversations of `turns` turns, served round robin, their KV `oversubscription` x the
    device KV cache; user messages are random tokens, the same for every config."""

    conversations: int = 8
    turns: int = 4
    user_tokens: int = 128
    answer_tokens: int = 32
    oversubscription: float = 4.0
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.turns * (self.user_tokens + self.answer_tokens) + 16

    def user_messages(self, vocab: int) -> list[list[list[int]]]:
        rng = random.Random(self.seed)
        return [[_tokens(rng, self.user_tokens, vocab) for _ in range(self.turns)]
                for _ in range(self.conversations)]


def run_chat(model_dir: str, users: list[list[list[int]]], answer_tokens: int,
             options: dict[str, Any]) -> dict[str, Any]:
    """Turn t of every conversation, round robin, one request at a time: each prompt is the
    previous prompt + its answer + the next user message."""
    from hybridkv import LLM, SamplingParams

    llm = LLM(model_dir, **options)
    try:
        params = SamplingParams(max_tokens=answer_tokens, temperature=0, ignore_eos=True)
        llm.generate([[5] * 32], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        histories: list[list[int]] = [[] for _ in users]
        answers: list[list[int]] = []
        prompt_tokens = prefilled = output_tokens = 0
        hits = dict.fromkeys(("device", *TIERS), 0)
        start = time.perf_counter()
        for turn in range(len(users[0])):
            for c, messages in enumerate(users):
                prompt = histories[c] + messages[turn]
                [out] = llm.generate([prompt], params, use_tqdm=False)
                prompt_tokens += len(prompt)
                prefilled += len(prompt) - out.num_cached_tokens
                output_tokens += len(out.token_ids)
                for tier, tokens in out.cached_tokens_by_tier.items():
                    hits[tier] = hits.get(tier, 0) + tokens
                histories[c] = prompt + out.token_ids
                answers.append(out.token_ids)
        wall = time.perf_counter() - start
        stats = llm.offload_stats()
    finally:
        llm.close()
    result: dict[str, Any] = {
        "prompt_tokens": prompt_tokens, "prefilled_tokens": prefilled, "hit_tokens": hits,
        "output_tokens": output_tokens, "wall_s": wall,
        "output_tokens_per_s": output_tokens / wall, "answers": answers}
    if stats is not None:
        result["blocks_stored"] = stats["blocks_stored"]
        result["blocks_loaded"] = stats["blocks_loaded"]
        result["bytes_stored"] = {t["tier"]: t["bytes_stored"] for t in stats["tiers"]}
        result["bytes_loaded"] = {t["tier"]: t["bytes_loaded"] for t in stats["tiers"]}
    return result


def bench_chat(model_dir: str, trace: ChatTrace, *, store: str,
               disk_root: str | None) -> dict[str, Any]:
    config = config_of(model_dir)
    # Every conversation's final context, and its last state checkpoint.
    trace_bytes = trace.conversations * kv_bytes(config, trace.max_model_len, 1)
    memory, _ = fit_kv_memory(model_dir, trace_bytes / trace.oversubscription,
                              trace.max_model_len)
    users = trace.user_messages(model_vocab(model_dir))
    base = dict(kv_cache_memory=memory, max_model_len=trace.max_model_len,
                allow_long_max_model_len=True)
    # Room for every block of the trace (checkpoints at every turn's end included) ...
    roomy = 2 * trace_bytes + trace.conversations * trace.turns * kv_bytes(config, 0, 1)
    results = {}
    with tempfile.TemporaryDirectory(prefix="hybridkv-offload-", dir=disk_root) as disk:
        configs = {
            "off": {},
            "cpu_evict": dict(kv_offload_cpu=roomy, kv_offload_store="evict"),
            "cpu_fill": dict(kv_offload_cpu=roomy, kv_offload_store="fill"),
            # ... or a CPU tier as small as the device cache (alone it would thrash: round
            # robin always wants the conversation least recently used) over a disk tier.
            "cpu_small_disk": dict(kv_offload_cpu=memory, kv_offload_store=store,
                                   kv_offload_disk=f"{disk}:{roomy}"),
        }
        for name, options in configs.items():
            results[name] = run_chat(model_dir, users, trace.answer_tokens,
                                     {**base, **options})
            gc.collect()  # one engine's arena and tiers at a time
    off_answers = results["off"]["answers"]
    for r in results.values():
        r["same_answers_as_off"] = r.pop("answers") == off_answers
    return {"conversations": trace.conversations, "turns": trace.turns,
            "user_tokens": trace.user_tokens, "answer_tokens": trace.answer_tokens,
            "kv_cache_memory": memory, "trace_kv_bytes": trace_bytes,
            "oversubscription": trace_bytes / memory, "tier_bytes": roomy, "configs": results}


# ---------------------------------------------------------------- the command

@contextlib.contextmanager
def _model(model_dir: str | None) -> Iterator[str]:
    """`model_dir`, or a small random Llama written for the run."""
    if model_dir is not None:
        yield model_dir
        return
    from hybridkv.models.demo import SIZES, write_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        yield str(write_demo_model(Path(tmp) / "llama", "llama", SIZES["small"]))


def bench_offload(model_dir: str | None, *, prefix_tokens: int = 8192, repeat: int = 3,
                  store: str = "evict", chat: ChatTrace | None = None,
                  disk_root: str | None = None, cold_disk: bool = False,
                  threads: int | None = None, seed: int = 0) -> dict[str, Any]:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    with _model(model_dir) as path:
        figures: dict[str, Any] = {
            "model": model_dir or "demo llama (small)",
            "model_type": load_hf_config(path).get("model_type"),
            "prefix_tokens": prefix_tokens, "suffix_tokens": SUFFIX_TOKENS, "repeat": repeat,
            "store_policy": store, "cold_disk": cold_disk, "threads": torch.get_num_threads()}
        figures.update(bench_ttft(path, prefix_tokens=prefix_tokens, repeat=repeat,
                                  store=store, disk_root=disk_root, cold_disk=cold_disk,
                                  seed=seed))
        if chat is not None:
            figures["chat"] = bench_chat(path, chat, store=store, disk_root=disk_root)
    return figures


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_figures(f: dict[str, Any]) -> str:
    ttft, hits, speedup = f["ttft_s"], f["hit_tokens"], f["speedup"]
    lines = [
        f"{f['model']} ({f['model_type']}) on {f['device']}, {f['threads']} threads: "
        f"{f['prefix_tokens']}-token prefix + {f['suffix_tokens']}-token suffix, 1 output "
        f"token, medians of {f['repeat']}; store policy {f['store_policy']}; disk reads "
        f"{'after dropping the page cache' if f['cold_disk'] else 'from the page cache'}",
        "",
        f"{'TTFT':<10} {'seconds':>9} {'speedup':>8} {'hit tokens (that tier)':>23}"]
    for case in CASES:
        lines.append(f"{case:<10} {ttft[case]:9.3f} "
                     f"{_num(speedup.get(case), '8.1f', 'x') if case != 'recompute' else '':>8}"
                     f" {hits[case]:>23}")
    bw = f["bandwidth_gbps"]
    plain = bw["plain_copy"]
    lines += ["", f"{'GB/s':<10} {'load':>7} {'of copy':>8} {'store':>7} {'of copy':>8} "
                  f"{'end-to-end load':>16}",
              f"{'copy':<10} {plain['load']:7.2f} {'':>8} {plain['store']:7.2f}"]
    for tier in TIERS:
        b = bw[tier]
        lines.append(f"{tier:<10} {_num(b['load'], '7.2f')} "
                     f"{_num(b['load_fraction'], '8.0%')} {_num(b['store'], '7.2f')} "
                     f"{_num(b['store_fraction'], '8.0%')} {_num(b['effective_load'], '16.2f')}")
    lines.append("(load: tier read + copy into the arena; store: copy out of the arena + the "
                 "tier's write; end-to-end: bytes / (TTFT of the tier - TTFT of a device hit))")
    if "chat" in f:
        lines += ["", *_chat_lines(f["chat"])]
    return "\n".join(lines)


def _chat_lines(c: dict[str, Any]) -> list[str]:
    lines = [
        f"chat: {c['conversations']} conversations x {c['turns']} turns round robin, "
        f"{c['user_tokens']}-token messages, {c['answer_tokens']}-token answers; their KV "
        f"{format_bytes(c['trace_kv_bytes'])} = {c['oversubscription']:.1f}x the device KV "
        f"cache ({format_bytes(c['kv_cache_memory'])})",
        f"{'config':<15} {'prefilled':>9} {'of prompt':>9} {'hits dev/cpu/disk':>20} "
        f"{'out tok/s':>9} {'wall s':>7} {'stored blocks':>13} {'stored bytes':>12} "
        f"{'same':>5}"]
    for name, r in c["configs"].items():
        h = r["hit_tokens"]
        stored = sum(r.get("bytes_stored", {}).values())
        lines.append(
            f"{name:<15} {r['prefilled_tokens']:9d} "
            f"{r['prefilled_tokens'] / r['prompt_tokens']:9.1%} "
            f"{h['device']:>6}/{h['cpu']:>6}/{h['disk']:>6} {r['output_tokens_per_s']:9.1f} "
            f"{r['wall_s']:7.1f} {r.get('blocks_stored', 0):13d} "
            f"{format_bytes(stored):>12} {r['same_answers_as_off']!s:>5}")
    lines.append("(same: the answers equal offloading off's, token for token)")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="a model directory (default: a small random Llama built on the "
                             "fly)")
    parser.add_argument("--prefix-tokens", type=positive_int, default=8192,
                        help="tokens of the long prefix whose reuse is timed")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="repeats of every TTFT case; medians reported")
    parser.add_argument("--store", choices=["evict", "fill"], default="evict",
                        help="the tiers' store policy (the chat trace runs both on the CPU "
                             "tier)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads (default: torch's)")
    parser.add_argument("--disk-dir", default=None,
                        help="where to create the disk tier's temporary directory (default: "
                             "the system's temporary directory)")
    parser.add_argument("--cold-disk", action="store_true",
                        help="drop the disk tier's files from the page cache before a disk "
                             "load")
    parser.add_argument("--chat", action="store_true",
                        help="also run the multi-turn chat trace")
    parser.add_argument("--conversations", type=positive_int, default=8,
                        help="chat: conversations, served round robin")
    parser.add_argument("--turns", type=positive_int, default=4, help="chat: turns of each")
    parser.add_argument("--user-tokens", type=positive_int, default=128,
                        help="chat: tokens of each user message (random)")
    parser.add_argument("--answer-tokens", type=positive_int, default=32,
                        help="chat: tokens of each answer")
    parser.add_argument("--seed", type=seed_number, default=0, help="seed of the random tokens")
    parser.add_argument("--remote", type=remote_url, default=None, metavar="URL",
                        help="instead: two replicas sharing this Redis (redis://HOST:PORT/DB)"
                             ", replica 2's TTFT from Redis vs recompute vs its CPU tier, and "
                             "load bandwidth vs redis-benchmark GETs (default: the local "
                             "tiers' cases)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_remote(args: argparse.Namespace) -> int:
    import torch

    from hybridkv.bench.offload_remote import bench_remote, format_remote

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with _model(args.model_dir) as path:
        figures = bench_remote(path, args.remote, prefix_tokens=args.prefix_tokens,
                               repeat=args.repeat, seed=args.seed)
    figures.update(model=args.model_dir or "demo llama (small)",
                   threads=torch.get_num_threads())
    print(json.dumps(figures) if args.json else "\n".join(format_remote(figures)))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.remote is not None:
        return run_remote(args)
    chat = ChatTrace(conversations=args.conversations, turns=args.turns,
                     user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                     seed=args.seed) if args.chat else None
    figures = bench_offload(args.model_dir, prefix_tokens=args.prefix_tokens,
                            repeat=args.repeat, store=args.store, chat=chat,
                            disk_root=args.disk_dir, cold_disk=args.cold_disk,
                            threads=args.threads, seed=args.seed)
    print(json.dumps(figures) if args.json else format_figures(figures))
    return 0


COMMAND = Command("offload", "KV offloading: TTFT of a prefix reloaded from each tier vs "
                             "recomputed, tier bandwidth, a multi-turn chat trace",
                  add_arguments, run)
