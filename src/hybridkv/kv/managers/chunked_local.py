"""Chunked local attention: a token attends only to tokens of its own chunk.

A hit at a chunk boundary needs no cached block at all; inside a chunk it needs the blocks
from the chunk's start. A chunk need not be a multiple of the block size (Llama 4 style
chunks of 20 on blocks of 16): the block a chunk boundary cuts holds tokens of both chunks
and stays with the later one; only blocks wholly before the current chunk are dropped.
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

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # Blocks wholly before this chunk's start (the base floors to whole blocks).
        return num_computed_tokens // self.chunk * self.chunk

    def next_drop(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk + 1) * self.chunk

    def chunk_start_block(self, num_blocks: int) -> int:
        """The first block a hit ending after `num_blocks` blocks needs: the one holding the
        start of the chunk of the next token (position num_blocks * block_size)."""
        return num_blocks * self.block_size // self.chunk * self.chunk // self.block_size

    def hit_needs(self, num_blocks: int) -> tuple[int, int] | None:
        return self.chunk_start_block(num_blocks), num_blocks

    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        first = managers[0]
        assert isinstance(first, ChunkedLocalManager)
        hashes, limit, align_blocks = first.hit_bounds(block_hashes, max_length, alignment)
        looked_up: dict[int, list[Block] | None] = {}

        def lookup(i: int) -> list[Block] | None:
            if i not in looked_up:
                looked_up[i] = first._lookup(managers, hashes[i])
            return looked_up[i]

        end = limit // align_blocks * align_blocks
        while end > 0:
            start = first.chunk_start_block(end)
            missing = next((i for i in range(end - 1, start - 1, -1) if lookup(i) is None),
                           None)
            if missing is None:
                rows = [row for i in range(start, end) if (row := lookup(i)) is not None]
                return [[m.null_block] * start + [row[k] for row in rows]
                        for k, m in enumerate(managers)]
            # Every end past the missing block needs it (its chunk starts at or before it,
            # as chunk starts only grow with the end): try the aligned ends before it.
            end = missing // align_blocks * align_blocks
        return [[] for _ in managers]
