"""`hit_needs` against the lookups: two answers to "how long a prefix can this request reuse".

The device lookup (`find_longest_cache_hit`, a fixed point over the groups' own searches) and
the offload connector (one pass over end points asking each group's `hit_needs`) must agree,
or a request would be promised a hit the device then refuses (or miss one it could have had).
For random groups of every kind and block size and random cached blocks per group:

    brute force  the largest e (a multiple of the hit alignment, <= max_length) where every
                 group's `hit_needs(e // block_size)` range is cached
    device       the coordinator's hit over the same cached blocks = the brute force
    connector    with the cached blocks split between the device and a tier, the load it
                 plans ends at the brute force over both, and it plans none when that is no
                 longer than the device's own hit
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.connector.base import LoadDone
from hybridkv.connector.offload import CPUTier
from hybridkv.connector.offload.chain import TierChain
from hybridkv.connector.scheduler import OffloadConnectorScheduler
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.plan import KVCacheConfig, KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import (
    ChunkedLocalAttentionSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

PAGE = 64  # bytes per large page: two 4-token attention blocks, one 8-token one


def attn(block_size: int) -> dict[str, object]:
    return dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype="fp32")


@st.composite
def specs(draw: st.DrawFn) -> KVCacheSpec:
    block_size = draw(st.sampled_from([4, 8]))
    kind = draw(st.sampled_from(["full", "sliding_window", "chunked_local", "mamba",
                                 "indexer_key", "compressed", "compressor_state"]))
    if kind == "full":
        return FullAttentionSpec(**attn(block_size))
    if kind == "indexer_key":
        # Keys per token or per 2 or 4 tokens: 4 to 32 bytes a block.
        return IndexerKeySpec(block_size=block_size, head_size=1, dtype="fp32",
                              compress_rate=draw(st.sampled_from([1, 2, 4])))
    if kind == "compressed":
        # Entries per 1, 2 or 4 tokens: 4 to 32 bytes a block.
        return CompressedAttentionSpec(block_size=block_size, head_size=1, dtype="fp32",
                                       compress_rate=draw(st.sampled_from([1, 2, 4])))
    if kind == "compressor_state":
        # With overlapping windows (CSA: the checkpoint at the hit point) and without (HCA:
        # nothing): 32 bytes.
        return CompressorStateSpec(block_size=block_size, shapes=((8,),), dtypes=("fp32",),
                                   compress_rate=draw(st.sampled_from([1, 2, 4])),
                                   overlap=draw(st.booleans()))
    if kind == "sliding_window":
        window = draw(st.sampled_from([1, 2, 5, 8, 13, 20]))
        return SlidingWindowSpec(sliding_window=window, **attn(block_size))
    if kind == "chunked_local":
        # Multiples of the block size and not (a chunk boundary inside a block).
        chunk = draw(st.sampled_from([block_size, 2 * block_size, 3 * block_size,
                                      block_size + block_size // 2, 5 * block_size // 4]))
        return ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **attn(block_size))
    return MambaSpec(block_size=block_size, shapes=((8,),), dtypes=("fp32",))  # 32 bytes


def config_of(group_specs: list[KVCacheSpec], num_pages: int) -> KVCacheConfig:
    groups = tuple(
        KVCacheGroup(group_id=i, spec=spec, layer_names=(f"layer{i}",),
                     layer_page_bytes=(spec.page_size_bytes,),
                     blocks_per_large_page=PAGE // spec.page_size_bytes)
        for i, spec in enumerate(group_specs))
    return KVCacheConfig(groups=groups, large_page_bytes=PAGE, num_large_pages=num_pages)


def group_hash(request: KVRequest, stride: int, index: int) -> BlockHash:
    return request.block_hashes[(index + 1) * stride - 1]


def brute_force(manager: KVCacheManager, request: KVRequest,
                cached: list[set[int]], max_length: int) -> int:
    """The longest hit by `hit_needs` alone, over the cached block indices per group."""
    alignment = manager.config.hit_alignment
    num_hash_tokens = len(request.block_hashes) * manager.config.hash_block_size
    for end in range(min(max_length, num_hash_tokens) // alignment * alignment, 0, -alignment):
        ok = True
        for m, blocks in zip(manager.managers, cached, strict=True):
            need = m.hit_needs(end // m.block_size)
            if need is None or not all(i in blocks for i in range(*need)):
                ok = False
                break
        if ok:
            return end
    return 0


def cache_blocks(manager: KVCacheManager, request: KVRequest, cached: list[set[int]]) -> None:
    """Put a block under each chosen hash, unreferenced (in the LRU, like a finished
    request's blocks)."""
    pool = manager.pool
    for m, indices in zip(manager.managers, cached, strict=True):
        for i in sorted(indices):
            [block] = pool.take(m.group_id, 1)
            pool.cache(block, group_hash(request, m.stride, i), value=(i + 1) * m.block_size)
            pool.free(m.group_id, [block])


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[KVCacheSpec], int, list[set[int]],
                                         list[set[int]], int]:
    """(group specs, prompt tokens, cached block indices per group on the device, the same
    in a tier, max_length)."""
    group_specs = draw(st.lists(specs(), min_size=1, max_size=4))
    num_tokens = draw(st.integers(1, 80))
    device, tier = [], []
    for spec in group_specs:
        num_blocks = num_tokens // spec.block_size
        indices = st.sets(st.integers(0, num_blocks - 1), max_size=num_blocks) \
            if num_blocks else st.just(set())
        # Mostly dense sets: sparse ones hit nothing and prove little.
        dense = st.integers(0, num_blocks).map(lambda n: set(range(n)))
        device.append(draw(st.one_of(indices, dense)))
        tier.append(draw(st.one_of(indices, dense)) if num_blocks else set())
    max_length = draw(st.integers(0, num_tokens))
    return group_specs, num_tokens, device, tier, max_length


def build(group_specs: list[KVCacheSpec], cached: list[set[int]]
          ) -> KVCacheManager:
    # Room for every cached block and every load without evicting: a page per block, x2.
    num_pages = 2 + 2 * sum(len(c) for c in cached) + 2 * 80 // 4 * len(group_specs)
    return KVCacheManager(config_of(group_specs, num_pages), max_model_len=256)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_the_device_lookup_is_the_largest_end_every_hit_needs_allows(scenario):
    group_specs, num_tokens, device, tier, max_length = scenario
    cached = [d | t for d, t in zip(device, tier, strict=True)]
    manager = build(group_specs, cached)
    request = KVRequest("r", list(range(1, num_tokens + 1)),
                        hash_block_size=manager.config.hash_block_size,
                        block_hasher=manager.block_hasher)
    cache_blocks(manager, request, cached)
    blocks, num_hit, _ = manager.coordinator.find_longest_cache_hit(request.block_hashes,
                                                                    max_length)
    expected = brute_force(manager, request, cached, max_length)
    assert num_hit == expected, (group_specs, cached, max_length)
    assert num_hit % manager.config.hit_alignment == 0
    for m, group_blocks in zip(manager.managers, blocks, strict=True):
        assert len(group_blocks) == num_hit // m.block_size
        need = m.hit_needs(num_hit // m.block_size)
        assert need is not None
        for i in range(*need):
            # The block the lookup hands over is the one cached under that prefix.
            assert group_blocks[i] is m.cached[group_hash(request, m.stride, i)]
    manager.pool.check_integrity()


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_the_connector_plans_the_load_the_device_lookup_then_finds(scenario):
    group_specs, num_tokens, device, tier, _ = scenario
    manager = build(group_specs, device)
    fingerprint = b"hit-needs"
    chain = TierChain(("cpu",), (CPUTier(1 << 20),))
    connector = OffloadConnectorScheduler(manager, chain, fingerprint)
    request = KVRequest("r", list(range(1, num_tokens + 1)),
                        hash_block_size=manager.config.hash_block_size,
                        block_hasher=manager.block_hasher)
    cache_blocks(manager, request, device)
    for m, indices in zip(manager.managers, tier, strict=True):
        for i in indices:
            chain.store(connector.key(m.group_id, group_hash(request, m.stride, i)), b"x")
    # What the scheduler does: the device lookup (the last token is always computed), then
    # the connector's offer to extend it.
    max_length = num_tokens - 1
    device_hit = manager.get_computed_blocks(request).num_computed_tokens
    assert device_hit == brute_force(manager, request, device, max_length)
    both = brute_force(manager, request, [d | t for d, t in zip(device, tier, strict=True)],
                       max_length)
    started = connector.start_load(request, device_hit)
    assert started == (both > device_hit), (group_specs, device, tier, device_hit, both)
    if not started:
        return
    load = connector._loads["r"]
    assert load.tokens == both
    # Every block it loads is one the device lacks, from the tier, within what the hit needs.
    for target in load.targets:
        m = manager.managers[target.group_id]
        index = target.value // m.block_size - 1
        assert index in tier[target.group_id] and index not in device[target.group_id]
        start, end = m.hit_needs(both // m.block_size)
        assert start <= index < end
    # Once the worker reports the loads done, the device lookup finds exactly that hit.
    connector.completions.put(LoadDone(load.job_id, tuple(0 for _ in load.targets), 0.0))
    assert connector.take_finished_loads() == ["r"]
    assert manager.get_computed_blocks(request).num_computed_tokens == both
    manager.pool.check_integrity()
