"""KV events from a running engine, read by a tiny indexer that knows only the events, the
documented hash and each group's hit rule: it predicts every next request's device hit
exactly, for full attention, sliding window + full attention, and Mamba + attention, while
the cache evicts and bursts of requests are preempted."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("msgpack")
pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.kv.hashing import BlockHasher  # noqa: E402
from tests.connector.vllm_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Subscriber,
    free_port,
)

SEED = "replicas-share-this"


class Indexer:
    """Per group: the hashes stored and not removed, the group's kind and block size."""

    def __init__(self, hash_block_size: int) -> None:
        self.hasher = BlockHasher(SEED)  # the documented hash: seed, xxh3, chained
        self.hash_block_size = hash_block_size
        self.cached: dict[int, set[int]] = {}
        self.kind: dict[int, tuple[str, int | None, int]] = {}
        self.num_removed = {0: 0, 1: 0}

    def apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert e.medium == "GPU" and e.group_idx is not None
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                self.kind[e.group_idx] = (str(e.kv_cache_spec_kind),
                                          e.kv_cache_spec_sliding_window, e.block_size)
                self.cached.setdefault(e.group_idx, set()).update(
                    int(h) for h in e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert e.group_idx is not None
                self.num_removed[e.group_idx] = self.num_removed.get(e.group_idx, 0) + 1
                for h in e.block_hashes:
                    self.cached[e.group_idx].remove(int(h))  # never removes an unknown hash
            else:
                assert isinstance(e, AllBlocksCleared)
                self.cached.clear()

    def group_hashes(self, token_ids: list[int], block_size: int) -> list[int]:
        hashes: list[bytes] = []
        self.hasher.extend_block_hashes(hashes, token_ids, self.hash_block_size)
        stride = block_size // self.hash_block_size
        return [int.from_bytes(h[-8:], "big") for h in hashes[stride - 1::stride]]

    def valid(self, group: int, hashes: list[int], num_blocks: int) -> bool:
        kind, window, block_size = self.kind[group]
        cached = self.cached.get(group, set())
        if kind == "full_attention":
            need = range(num_blocks)
        elif kind == "sliding_window":
            assert window is not None
            need = range(max(0, num_blocks - math.ceil((window - 1) / block_size)), num_blocks)
        else:
            assert kind == "mamba"
            need = range(num_blocks - 1, num_blocks) if num_blocks else range(0)
        return all(hashes[i] in cached for i in need)

    def predict(self, token_ids: list[int], groups: list[int]) -> int:
        """The longest prefix every group can serve, ending on every group's block boundary,
        before the last token (its logits are needed)."""
        sizes = {g: self.kind[g][2] for g in groups}
        align = math.lcm(*sizes.values())
        hashes = {g: self.group_hashes(token_ids, sizes[g]) for g in groups}
        for end in range((len(token_ids) - 1) // align * align, 0, -align):
            if all(self.valid(g, hashes[g], end // sizes[g]) for g in groups):
                return end
        return 0


def run_workload(model_dir: Path, *, kv_cache_memory: str, num_requests: int = 24
                 ) -> tuple[Indexer, list[tuple[int, int]]]:
    port = free_port()
    sub = Subscriber(port)
    llm = LLM(str(model_dir), max_model_len=256, kv_cache_memory=kv_cache_memory,
              block_hash_seed=SEED, kv_events_endpoint=f"tcp://*:{port}")
    engine: Any = llm.engine
    time.sleep(0.5)  # the SUB socket (re)connects to the endpoint just bound
    config = engine.plan.config
    indexer = Indexer(config.hash_block_size)
    groups = list(range(len(config.groups)))
    rng = random.Random(0)
    # Conversations sharing system prompts, growing turn by turn; users interleaved.
    systems = [[rng.randrange(3, 250) for _ in range(40 + 13 * s)] for s in range(3)]
    histories = [list(systems[u % 3]) for u in range(6)]
    results = []
    try:
        for i in range(num_requests):
            user = rng.randrange(6)
            if len(histories[user]) > 190:  # the conversation ends; the user starts again
                histories[user] = list(systems[user % 3])
            histories[user] += [rng.randrange(3, 250) for _ in range(rng.randrange(5, 40))]
            prompt = histories[user]
            if engine.kv_events.next_seq:  # every batch so far has arrived
                sub.drain(engine.kv_events.next_seq - 1)
            for batch in sub.batches:
                indexer.apply(batch)
            sub.batches.clear()
            predicted = indexer.predict(prompt, groups) if indexer.kind else 0
            [out] = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0),
                                 use_tqdm=False)
            histories[user] = prompt + out.token_ids
            results.append((predicted, out.num_cached_tokens))
            if i == num_requests // 2:
                assert llm.reset_prefix_cache()
            if i % 8 == 4:
                # A burst of long requests at once, more than the cache holds: the scheduler
                # preempts some, freeing their blocks mid-request, and evicts; the next
                # predictions must still be exact.
                burst = [histories[u % 6][:150] + [rng.randrange(3, 250) for _ in range(30)]
                         for u in range(8)]
                llm.generate(burst, SamplingParams(max_tokens=48, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
        sub.close()
    assert engine.scheduler.num_preemptions > 0, "the bursts preempt"
    assert engine.kv_events.num_dropped == 0
    assert sub.seqs == list(range(len(sub.seqs))), "no sequence number skipped"
    return indexer, results


@pytest.mark.parametrize("arch", ["llama", "gemma3", "nemotron_h"])
def test_an_indexer_fed_by_events_predicts_every_hit(tmp_path: Path, arch: str) -> None:
    from hybridkv.models.demo import demo_shape, write_demo_model

    model = write_demo_model(tmp_path / arch, arch, demo_shape("small", layers=6, window=32))
    # A small cache: conversations evict each other's blocks.
    indexer, results = run_workload(model, kv_cache_memory="1MiB")
    assert [p for p, _ in results] == [hit for _, hit in results]
    assert sum(hit for _, hit in results) > 0, "the workload has prefix hits"
    assert sum(indexer.num_removed.values()) > 0, "the workload evicts"


def tier_events(batches: list[KVEventBatch]) -> dict[str, dict[int, int]]:
    """Per medium, the blocks the events say it holds (hash -> group), after checking that
    a medium only ever removes what it announced."""
    held: dict[str, dict[int, int]] = {}
    for batch in batches:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):  # the device's prefix cache reset
                held["GPU"] = {}
                continue
            assert e.group_idx is not None and e.medium is not None
            blocks = held.setdefault(e.medium, {})
            if isinstance(e, BlockStored):
                if e.medium != "GPU":  # a tier's stores carry hashes only, as in vLLM
                    assert e.token_ids == [] and e.parent_block_hash is None
                    assert e.block_size == 16
                blocks.update((int(h), e.group_idx) for h in e.block_hashes)
            else:
                for h in e.block_hashes:
                    assert blocks.pop(int(h)) == e.group_idx, f"{e.medium} removed {h}"
    return held


def tier_hashes(keys: list[bytes]) -> dict[int, int]:
    from hybridkv.connector.offload.store import parse_key

    out = {}
    for key in keys:
        _, group, block_hash = parse_key(key)
        out[int.from_bytes(block_hash[-8:], "big")] = group
    return out


def test_offload_tiers_publish_their_stores_and_evictions(tmp_path: Path) -> None:
    from tests.models.tiny import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (70, 90, 100)]
    port = free_port()
    sub = Subscriber(port)
    disk = tmp_path / "kv"
    # A block is 8 KiB (2 layers x K, V x 2 heads x 16 dims x 16 tokens x fp32): the CPU
    # tier holds 8 and evicts, the disk tier holds them all.
    llm = LLM(str(model), dtype="float32", device="cpu", max_model_len=256,
              kv_cache_memory="4MiB", block_hash_seed=SEED, kv_events_endpoint=f"tcp://*:{port}",
              kv_offload_cpu="64KiB", kv_offload_disk=f"{disk}:1MiB")
    engine: Any = llm.engine
    time.sleep(0.5)  # the SUB socket (re)connects to the endpoint just bound
    try:
        first = llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
        assert llm.reset_prefix_cache()  # store policy "evict": the device cache goes to tiers
        second = llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
        assert [o.token_ids for o in first] == [o.token_ids for o in second]
        assert sum(o.cached_tokens_by_tier["disk"] + o.cached_tokens_by_tier["cpu"]
                   for o in second) > 0
        chain = engine.connector.chain
    finally:
        llm.close()  # the tiers' last writes, then their events
    sub.drain(engine.kv_events.next_seq - 1)
    sub.close()
    held = tier_events(sub.batches)
    cpu, disk_tier = chain.tiers
    assert cpu.stats.evictions > 0, "the CPU tier was full and evicted"
    # What the events say each tier holds is what it holds.
    assert held["CPU"] == tier_hashes(cpu.keys())
    assert held["STORAGE"] == tier_hashes(disk_tier.live_keys())
    # Every block the device computed reached the disk (write-through), and the CPU tier's
    # removals were announced.
    assert set(held["STORAGE"]) >= set(held["GPU"]) and held["GPU"]
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU"
               for b in sub.batches for e in b.events)

    # A new engine on the same (warm) directory announces what the disk holds.
    port = free_port()
    sub = Subscriber(port)
    again = LLM(str(model), dtype="float32", device="cpu", max_model_len=256,
                kv_cache_memory="4MiB", block_hash_seed=SEED,
                kv_events_endpoint=f"tcp://*:{port}", kv_offload_disk=f"{disk}:1MiB")
    time.sleep(0.5)
    try:
        again.engine.step()  # an idle step publishes what is pending
        sub.drain(0)
    finally:
        again.close()
        sub.close()
    assert tier_events(sub.batches[:1])["STORAGE"] == held["STORAGE"]
