"""Sliding window: a token attends to itself and the `window - 1` tokens before it.

A hit at block boundary `e` needs only the `ceil((window - 1) / block_size)` blocks before
`e`; blocks before those may have been evicted (they are null in the hit). So the search runs
from the right, looking for the rightmost run of that many cached blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers.base import SingleTypeManager
from hybridkv.kv.spec import SlidingWindowSpec, cdiv


class SlidingWindowManager(SingleTypeManager):
    @property
    def window(self) -> int:
        assert isinstance(self.spec, SlidingWindowSpec)
        return self.spec.sliding_window

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next token (position num_computed_tokens) looks back window - 1 positions.
        return max(0, num_computed_tokens - self.window + 1)

    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        first = managers[0]
        assert isinstance(first, SlidingWindowManager)
        block_size = first.block_size
        hashes = first.group_hashes(block_hashes)
        limit = min(max_length // block_size, len(hashes))
        align_blocks = alignment // block_size
        needed = cdiv(first.window - 1, block_size)
        hits: list[list[Block]] = [[m.null_block] * limit for m in managers]
        if needed == 0:
            end = limit // align_blocks * align_blocks
            return [blocks[:end] for blocks in hits]
        run = 0  # cached blocks contiguous from i to the right
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
