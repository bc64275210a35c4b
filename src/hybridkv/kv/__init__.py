"""The hybrid KV cache manager: pure Python, no torch, no model code.

specs (spec.py) -> plan (plan.py) -> block pool (block_pool.py) -> per-kind managers
(managers/) -> coordinator (coordinator.py) -> KVCacheManager (manager.py).
"""

from hybridkv.kv.manager import ComputedBlocks, KVCacheBlocks, KVCacheManager
from hybridkv.kv.plan import KVCacheConfig, KVCacheGroup, KVCachePlan, plan_kv_cache
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlySpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "ChunkedLocalAttentionSpec", "ComputedBlocks", "CrossAttentionSpec", "EncoderOnlySpec",
    "FullAttentionSpec", "KVCacheBlocks", "KVCacheConfig", "KVCacheGroup", "KVCacheManager",
    "KVCachePlan", "KVCacheSpec", "KVRequest", "MLAAttentionSpec", "MambaSpec",
    "SlidingWindowSpec", "plan_kv_cache",
]
