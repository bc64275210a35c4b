"""Prefix hits across all groups, and the per-group managers behind them.

The hybrid hit is the longest prefix every group can reuse: a fixed point.

    candidate = max hit length, rounded down to the LCM of the groups' block sizes
    repeat:  for each kind, ask for its longest hit not beyond the candidate
             candidate = the minimum of the answers
    until no kind lowers it

Every answer is the largest hit that kind allows below the candidate, so a hit valid for all
groups can never be skipped, and the result is the longest one. Full attention's valid hits
are downward closed: it is asked once and then only trimmed.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kv.block_pool import Block, BlockPool
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.managers import SingleTypeManager, manager_class
from hybridkv.kv.plan import KVCacheConfig


class KVCacheCoordinator:
    """No prefix caching: every lookup misses."""

    def __init__(self, config: KVCacheConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.alignment = config.hit_alignment
        self.managers: list[SingleTypeManager] = [
            manager_class(g.spec.kind)(g, pool, config.hash_block_size) for g in config.groups]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int
                               ) -> tuple[tuple[list[Block], ...], int, list[int]]:
        """(hit blocks per group, hit tokens, each group's own longest hit in tokens)."""
        return tuple([] for _ in self.managers), 0, [0] * len(self.managers)


class UnitaryCoordinator(KVCacheCoordinator):
    """One group: its own longest hit is the answer."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int
                               ) -> tuple[tuple[list[Block], ...], int, list[int]]:
        manager = self.managers[0]
        [blocks] = type(manager).find_longest_cache_hit(
            [manager], block_hashes, max_length, self.alignment)
        num_tokens = len(blocks) * manager.block_size
        return (blocks,), num_tokens, [num_tokens]


class HybridCoordinator(KVCacheCoordinator):
    """Any number of groups of any kinds: the fixed point above."""

    def __init__(self, config: KVCacheConfig, pool: BlockPool) -> None:
        super().__init__(config, pool)
        # Groups whose managers answer lookups identically share one lookup.
        buckets: dict[tuple[object, ...], list[int]] = {}
        for group_id, manager in enumerate(self.managers):
            buckets.setdefault(manager.hit_key(), []).append(group_id)
        # Monotone kinds first: their answer starts the candidate off low.
        self.lookups = sorted(buckets.values(),
                              key=lambda ids: not self.managers[ids[0]].hit_is_monotone)
        self.lookup_managers = [[self.managers[g] for g in ids] for ids in self.lookups]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int
                               ) -> tuple[tuple[list[Block], ...], int, list[int]]:
        candidate = max_length // self.alignment * self.alignment
        hits: list[list[list[Block]] | None] = [None] * len(self.lookups)
        lengths = [0] * len(self.lookups)
        own = [0] * len(self.managers)
        stable = False
        while not stable:
            stable = True
            for k, (group_ids, managers) in enumerate(
                    zip(self.lookups, self.lookup_managers, strict=True)):
                first = managers[0]
                if hits[k] is not None and (lengths[k] == candidate or first.hit_is_monotone):
                    continue  # still valid at the candidate (after trimming)
                found = type(first).find_longest_cache_hit(
                    managers, block_hashes, candidate, self.alignment)
                length = len(found[0]) * first.block_size
                if hits[k] is None:
                    for g in group_ids:
                        own[g] = length
                hits[k], lengths[k] = found, length
                if length < candidate:
                    candidate, stable = length, False
        result: list[list[Block]] = [[] for _ in self.managers]
        for group_ids, group_hits in zip(self.lookups, hits, strict=True):
            assert group_hits is not None
            for g, blocks in zip(group_ids, group_hits, strict=True):
                result[g] = blocks[:candidate // self.managers[g].block_size]
        return tuple(result), candidate, own


def make_coordinator(config: KVCacheConfig, pool: BlockPool, *,
                     enable_caching: bool) -> KVCacheCoordinator:
    if not enable_caching:
        return KVCacheCoordinator(config, pool)
    if len(config.groups) == 1:
        return UnitaryCoordinator(config, pool)
    return HybridCoordinator(config, pool)
