"""Chunked local attention: a token attends only to tokens of its own chunk.

A hit at a chunk boundary needs no cached block at all; inside a chunk it needs the blocks
from the chunk's start, so only the current chunk is ever searched.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers.base import SingleTypeManager
from hybridkv.kv.plan import KVCacheGroup
from hybridkv.kv.spec import ChunkedLocalAttentionSpec


class ChunkedLocalManager(SingleTypeManager):
    def __init__(self, group: KVCacheGroup, pool: BlockPool, hash_block_size: int) -> None:
        super().__init__(group, pool, hash_block_size)
        assert isinstance(self.spec, ChunkedLocalAttentionSpec)
        self.chunk = self.spec.attention_chunk_size
        if self.chunk % self.block_size:
            raise ValueError(f"attention_chunk_size {self.chunk} must be a multiple of the "
                             f"block size {self.block_size} for hybrid KV management")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.chunk * self.chunk

    def next_drop(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk + 1) * self.chunk

    def hit_needs(self, num_blocks: int) -> tuple[int, int] | None:
        chunk_blocks = self.chunk // self.block_size
        return num_blocks // chunk_blocks * chunk_blocks, num_blocks

    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        first = managers[0]
        assert isinstance(first, ChunkedLocalManager)
        block_size = first.block_size
        hashes, limit, align_blocks = first.hit_bounds(block_hashes, max_length, alignment)
        chunk_blocks = first.chunk // block_size
        start = limit // chunk_blocks * chunk_blocks  # first block of the last chunk
        while True:
            found_blocks: list[list[Block]] = [[] for _ in managers]
            for i in range(start, limit):
                found = first._lookup(managers, hashes[i])
                if found is None:
                    break
                for blocks, block in zip(found_blocks, found, strict=True):
                    blocks.append(block)
            end = (start + len(found_blocks[0])) // align_blocks * align_blocks
            if end >= start:
                return [[m.null_block] * start + blocks[:end - start]
                        for m, blocks in zip(managers, found_blocks, strict=True)]
            # No aligned end in this chunk: try the previous one, ending before this chunk.
            limit = start - 1
            start -= chunk_blocks
