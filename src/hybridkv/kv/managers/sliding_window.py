"""Sliding window: a token attends to itself and the `window - 1` tokens before it.

A hit at block boundary `e` needs only the `ceil((window - 1) / block_size)` blocks before
`e`; blocks before those may have been evicted (they are null in the hit). So the search runs
from the right, looking for the rightmost run of that many cached blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers.base import SingleTypeManager
from hybridkv.kv.plan import KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import SlidingWindowSpec, cdiv


class SlidingWindowManager(SingleTypeManager):
    def __init__(self, group: KVCacheGroup, pool: BlockPool, hash_block_size: int) -> None:
        super().__init__(group, pool, hash_block_size)
        assert isinstance(self.spec, SlidingWindowSpec)
        self.window = self.spec.sliding_window

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next token (position num_computed_tokens) looks back window - 1 positions.
        return max(0, num_computed_tokens - self.window + 1)

    def next_drop(self, num_computed_tokens: int) -> int:
        dropped = max(0, self.num_skipped_tokens(num_computed_tokens) // self.block_size)
        return (dropped + 1) * self.block_size + self.window - 1

    def drop_skipped_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        # Called every step for every request: the common "nothing new to drop" case first.
        num_skipped = (num_computed_tokens - self.window + 1) // self.block_size
        if num_skipped <= 0:
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks or blocks[min(num_skipped, len(blocks)) - 1] is self.null_block:
            return
        super().drop_skipped_blocks(request, num_computed_tokens)

    def hit_needs(self, num_blocks: int) -> tuple[int, int] | None:
        return max(0, num_blocks - cdiv(self.window - 1, self.block_size)), num_blocks

    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        first = managers[0]
        assert isinstance(first, SlidingWindowManager)
        block_size = first.block_size
        hashes, limit, align_blocks = first.hit_bounds(block_hashes, max_length, alignment)
        needed = cdiv(first.window - 1, block_size)
        hits: list[list[Block]] = [[m.null_block] * limit for m in managers]
        if needed == 0:
            end = limit // align_blocks * align_blocks
            return [blocks[:end] for blocks in hits]
        run = 0  # cached blocks contiguous from i to the right
        if len(managers) == 1:
            # The common case, kept tight; the same walk as below.
            [hit] = hits
            cached = first.cached
            for i in range(limit - 1, -1, -1):
                block = cached.get(hashes[i])
                if block is None:
                    run = 0
                    continue
                hit[i] = block
                run += 1
                if run >= needed and (i + needed) % align_blocks == 0:
                    del hit[i + needed:]
                    return hits
            del hit[min(run, needed - 1) // align_blocks * align_blocks:]
            return hits
        # E.g. needed 2, cached pattern [x x . x x x] scanning from the right: run reaches 2 at
        # i=4 -> end 6 (if aligned), else i=3 -> end 5, ...
        for i in range(limit - 1, -1, -1):
            found = first._lookup(managers, hashes[i])
            if found is None:
                run = 0
                continue
            for blocks, block in zip(hits, found, strict=True):
                blocks[i] = block
            run += 1
            if run >= needed and (i + needed) % align_blocks == 0:
                return [blocks[:i + needed] for blocks in hits]
        # Short hits whose window reaches back past position 0: blocks [0, end) all cached.
        end = min(run, needed - 1) // align_blocks * align_blocks
        return [blocks[:end] for blocks in hits]
