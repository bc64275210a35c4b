"""Indexer keys: a lightning indexer scores each query against the keys of every earlier
entry and keeps the top k, so no entry ever falls out of use and a prefix hit needs the
entries of every cached position: full attention's rule, on the indexer's own pages.

    hit ending after block e needs blocks [0, e), all cached; the hit is monotone

A group of its own (not pages inside the attention layer's group) because its pages have
their own size and dtype and, with a `compress_rate`, their own entries per token; the
coordinator's fixed point then makes a hit end only where both the attention group and the
indexer group hold everything.
"""

from __future__ import annotations

from hybridkv.kv.block_pool import BlockPool
from hybridkv.kv.managers.full import FullAttentionManager
from hybridkv.kv.plan import KVCacheGroup
from hybridkv.kv.spec import IndexerKeySpec


class IndexerKeyManager(FullAttentionManager):
    """Every block kept, leading cached blocks hit (FullAttentionManager's walk): the
    indexer may select any earlier entry, whatever the attention layer beside it drops."""

    def __init__(self, group: KVCacheGroup, pool: BlockPool, hash_block_size: int) -> None:
        super().__init__(group, pool, hash_block_size)
        assert isinstance(self.spec, IndexerKeySpec)
