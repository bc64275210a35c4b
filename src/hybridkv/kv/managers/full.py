"""Full attention: every token attends to every earlier one, so all blocks are kept."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers.base import SingleTypeManager
from hybridkv.kv.request import KVRequest


class FullAttentionManager(SingleTypeManager):
    hit_is_monotone = True

    def drop_skipped_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        return  # every block stays needed

    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        first = managers[0]
        hashes, limit, align_blocks = first.hit_bounds(block_hashes, max_length, alignment)
        if len(managers) == 1:
            # The common case, kept tight: leading cached blocks, left to right.
            cached = first.cached
            hit: list[Block] = []
            for block_hash in hashes[:limit]:
                block = cached.get(block_hash)
                if block is None:
                    break
                hit.append(block)
            del hit[len(hit) // align_blocks * align_blocks:]
            return [hit]
        hits: list[list[Block]] = [[] for _ in managers]
        for block_hash in hashes[:limit]:
            found = first._lookup(managers, block_hash)
            if found is None:
                break
            for blocks, block in zip(hits, found, strict=True):
                blocks.append(block)
        num = len(hits[0]) // align_blocks * align_blocks
        return [blocks[:num] for blocks in hits]
