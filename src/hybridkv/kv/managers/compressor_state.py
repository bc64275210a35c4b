"""A compressed-attention layer's compressor state: the tokens since its last closed
window, and (overlapping windows) the last closed window's first half-projections.

What a hit at p (a window boundary: every block boundary is one) needs:

    HCA (no overlap)   buffer empty at p, nothing else carried  ->  no block at all
                       hit blocks [null, ..., null]; a fresh live state serves
    CSA (overlap)      entry p / rate reads window p / rate - 1's first halves, computed
                       from tokens inside the hit  ->  the checkpoint at p (Mamba's rule)
                       hit blocks [null, ..., null, checkpoint]

Both hold one live state per request (MambaManager's allocation); only the overlapping
kind saves checkpoints, since only its hits read them.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers.base import SingleTypeManager
from hybridkv.kv.managers.mamba import MambaManager
from hybridkv.kv.plan import KVCacheGroup
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import CompressorStateSpec


class CompressorStateManager(MambaManager):
    def __init__(self, group: KVCacheGroup, pool: BlockPool, hash_block_size: int) -> None:
        super().__init__(group, pool, hash_block_size)
        assert isinstance(self.spec, CompressorStateSpec)
        self.overlap = self.spec.overlap
        if not self.overlap:
            self.checkpoint_branch_points = False

    def hit_needs(self, num_blocks: int) -> tuple[int, int] | None:
        if not self.overlap:
            return num_blocks, num_blocks  # nothing to have cached
        return super().hit_needs(num_blocks)

    @classmethod
    def find_longest_cache_hit(cls, managers: Sequence[SingleTypeManager],
                               block_hashes: Sequence[BlockHash], max_length: int,
                               alignment: int) -> list[list[Block]]:
        first = managers[0]
        assert isinstance(first, CompressorStateManager)
        if first.overlap:
            return super().find_longest_cache_hit(managers, block_hashes, max_length,
                                                  alignment)
        # Any aligned end within the request's hashed blocks: the buffer is empty there.
        _, limit, align_blocks = first.hit_bounds(block_hashes, max_length, alignment)
        end = limit // align_blocks * align_blocks
        return [[m.null_block] * end for m in managers]

    def note_lookup(self, request: KVRequest, matched_tokens: int) -> None:
        if self.overlap:
            super().note_lookup(request, matched_tokens)

    def set_checkpoint_policy(self, *, interval: int, branch_points: bool, tail: int = 1,
                              remember_blocks: bool = False) -> None:
        if self.overlap:
            super().set_checkpoint_policy(interval=interval, branch_points=branch_points,
                                          tail=tail, remember_blocks=remember_blocks)
