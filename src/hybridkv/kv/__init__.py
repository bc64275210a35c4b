"""The hybrid KV cache manager: pure Python, no torch, no model code.

specs (spec.py) -> plan (plan.py) -> block pool (block_pool.py, with its eviction policy in
eviction.py) -> per-kind managers (managers/) -> coordinator (coordinator.py) ->
KVCacheManager (manager.py). Block hashes: hashing.py.
"""

from hybridkv.kv.hashing import BlockHasher, hash_fingerprint, make_block_hasher
from hybridkv.kv.manager import ComputedBlocks, KVCacheBlocks, KVCacheManager
from hybridkv.kv.plan import KVCacheConfig, KVCacheGroup, KVCachePlan, plan_kv_cache
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import (
    ChunkedLocalAttentionSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    CrossAttentionSpec,
    EncoderOnlySpec,
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    MLASlidingWindowSpec,
    SlidingWindowSpec,
)

__all__ = [
    "BlockHasher", "ChunkedLocalAttentionSpec", "CompressedAttentionSpec",
    "CompressorStateSpec", "ComputedBlocks", "CrossAttentionSpec",
    "EncoderOnlySpec", "FullAttentionSpec", "IndexerKeySpec", "KVCacheBlocks",
    "KVCacheConfig", "KVCacheGroup", "KVCacheManager", "KVCachePlan", "KVCacheSpec",
    "KVRequest", "MLAAttentionSpec", "MLASlidingWindowSpec", "MambaSpec", "SlidingWindowSpec",
    "hash_fingerprint", "make_block_hasher", "plan_kv_cache",
]
