"""Compressed attention (DeepSeek-V4's CSA and HCA): one entry per `compress_rate` tokens,
and every later query may read any of them (HCA attends to all; CSA's indexer may choose
any), so no entry falls out of use and a prefix hit needs every entry before it: full
attention's rule, on pages of entries.

    rate 4, block 16 (4 entries): hit ending after block e needs blocks [0, e), all cached

A block boundary is a window boundary (the spec makes the block a multiple of the rate),
so the entries of a hit are all closed windows; what the compressor carried past them is
its state group's business (kv/managers/compressor_state.py).
"""

from __future__ import annotations

from hybridkv.kv.block_pool import BlockPool
from hybridkv.kv.managers.full import FullAttentionManager
from hybridkv.kv.plan import KVCacheGroup
from hybridkv.kv.spec import CompressedAttentionSpec


class CompressedAttentionManager(FullAttentionManager):
    """Every block kept, leading cached blocks hit (FullAttentionManager's walk)."""

    def __init__(self, group: KVCacheGroup, pool: BlockPool, hash_block_size: int) -> None:
        super().__init__(group, pool, hash_block_size)
        assert isinstance(self.spec, CompressedAttentionSpec)
