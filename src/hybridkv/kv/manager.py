"""KVCacheManager: the scheduler's one door to the KV cache.

    hit = manager.get_computed_blocks(request)            # a question: no side effects
    new = manager.allocate_slots(request, num_new_tokens,  # all groups or none
                                 hit.num_computed_tokens, hit.blocks)
    ...
    manager.free(request)

The scheduler sees only block ids per group; it never learns what kind a group is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from hybridkv.kv.block_pool import Block, BlockPool, BlockRemoved, BlockStored
from hybridkv.kv.coordinator import make_coordinator
from hybridkv.kv.hashing import make_block_hasher
from hybridkv.kv.managers.base import NEVER
from hybridkv.kv.plan import KVCacheConfig
from hybridkv.kv.request import KVRequest
from hybridkv.kv.spec import DEFAULT_CHECKPOINT_TAIL, FullAttentionSpec, MambaSpec


class KVCacheBlocks:
    """Blocks per group (outer index = group id), and the state checkpoints the model runner
    must write in this step: (group id, token position, block id)."""

    __slots__ = ("blocks", "checkpoints")

    def __init__(self, blocks: tuple[list[Block], ...],
                 checkpoints: tuple[tuple[int, int, int], ...] = ()) -> None:
        self.blocks = blocks
        self.checkpoints = checkpoints

    def block_ids(self) -> list[list[int]]:
        return [[b.block_id for b in blocks] for blocks in self.blocks]

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.block_ids()})"


class ComputedBlocks(NamedTuple):
    blocks: KVCacheBlocks
    num_computed_tokens: int


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # lookups
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    # Per group, summed over lookups: the hit it allowed when first asked. Groups are asked
    # full attention first, each bounded by the candidate the groups before it left.
    hit_tokens_per_group: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, *, max_model_len: int,
                 enable_caching: bool = True, enable_events: bool = False,
                 checkpoint_interval: int = 0, checkpoint_branch_points: bool = True,
                 checkpoint_tail: int = DEFAULT_CHECKPOINT_TAIL,
                 eviction: str | None = None, hash_seed: str | bytes | None = None,
                 hash_algo: str = "xxh3") -> None:
        self.config = config
        # Requests must hash with this hasher (KVRequest(..., block_hasher=...)). No seed:
        # this process's random one; processes sharing cached blocks set one secret seed.
        self.block_hasher = make_block_hasher(hash_seed, hash_algo)
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        if eviction is None:
            # Cost-aware eviction where blocks differ in what they spare per byte (state
            # checkpoints vs attention blocks); between attention groups plain LRU, whose
            # admission check is exact.
            has_state = any(g.spec.is_state for g in config.groups)
            eviction = "value" if has_state else "lru"
        self.pool = BlockPool(config, enable_caching=enable_caching,
                              enable_events=enable_events, eviction=eviction)
        self.coordinator = make_coordinator(config, self.pool, enable_caching=enable_caching)
        self.managers = self.coordinator.managers
        if enable_caching:
            # Branch points come from a full-attention group's match (the only monotone
            # one); without one (pure SSMs, sliding window + state) the state groups
            # remember the hashes of computed blocks instead.
            no_full = not any(isinstance(g.spec, FullAttentionSpec) for g in config.groups)
            for m in self.managers:
                m.set_checkpoint_policy(interval=checkpoint_interval,
                                        branch_points=checkpoint_branch_points,
                                        tail=checkpoint_tail, remember_blocks=no_full)
        self.stats = PrefixCacheStats(hit_tokens_per_group=[0] * len(self.managers))
        state_specs = [g.spec for g in config.groups if isinstance(g.spec, MambaSpec)]
        self._speculative_states = any(s.num_drafting_blocks for s in state_specs)
        # Requests whose drafts one step may score (None: no limit; state groups bound it).
        self.max_drafting_requests = min(
            (s.max_speculative_requests for s in state_specs if s.num_drafting_blocks),
            default=None)
        self._no_blocks = KVCacheBlocks(tuple([] for _ in self.managers))
        # Per request: token counts below which allocate_slots has nothing to do.
        self._quiet: dict[str, tuple[int, int, int]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def get_computed_blocks(self, request: KVRequest) -> ComputedBlocks:
        """The longest prefix of `request` cached in every group. The last token is always
        recomputed (its logits are needed), so a hit stops before it."""
        if not self.enable_caching:
            return ComputedBlocks(self._no_blocks, 0)
        self._check_hasher(request)
        blocks, num_tokens, own = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1)
        stats = self.stats
        stats.num_queries += 1
        stats.num_queried_tokens += request.num_tokens
        stats.num_hit_tokens += num_tokens
        for g, n in enumerate(own):
            stats.hit_tokens_per_group[g] += n
        for m in self.managers:
            m.note_lookup(request, max(own))
        return ComputedBlocks(KVCacheBlocks(blocks), num_tokens)

    @property
    def hash_fingerprint(self) -> str:
        """Names the block hash algorithm and seed (for tiers' layout fingerprints)."""
        return self.block_hasher.fingerprint

    def _check_hasher(self, request: KVRequest) -> None:
        if request.block_hasher is not self.block_hasher and \
                request.block_hasher != self.block_hasher:
            raise ValueError(
                f"request {request.request_id} was hashed with {request.block_hasher}, this "
                f"KV cache with {self.block_hasher}: pass KVRequest(..., block_hasher="
                f"manager.block_hasher)")

    def allocate_slots(self, request: KVRequest, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Blocks for `num_new_tokens` more tokens (after adopting a prefix hit of
        `num_new_computed_tokens` tokens), in every group, or None if they do not all fit.
        Returns only the newly allocated blocks per group."""
        num_computed = request.num_computed_tokens
        total_computed = num_computed + num_new_computed_tokens
        # A step scoring drafts on a model with state groups takes a block for the state at
        # the known tokens (kv/managers/mamba.py): never a quiet one.
        drafting = self._speculative_states and \
            total_computed + num_new_tokens > request.num_tokens
        if new_computed_blocks is None and num_new_tokens > 0 and not drafting:
            # Most decode steps stay inside the last block: nothing to drop, allocate or cache.
            quiet = self._quiet.get(request.request_id)
            if (quiet is not None and num_computed <= quiet[2]
                    and total_computed + num_new_tokens <= quiet[1]
                    and total_computed + num_new_tokens + num_lookahead_tokens <= quiet[0]):
                return self._no_blocks
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        managers = self.managers
        num_tokens = min(total_computed + num_new_tokens + num_lookahead_tokens,
                         self.max_model_len)
        num_to_cache = min(total_computed + num_new_tokens, request.num_tokens)
        hit = new_computed_blocks.blocks if new_computed_blocks is not None else None
        # Blocks that no future token can attend to go back before anything is counted.
        for m in managers:
            m.drop_skipped_blocks(request, num_computed)
        if hit is None:
            needs = [m.num_blocks_to_allocate(request, num_tokens, 0) for m in managers]
            if any(needs) and not self.pool.can_take(needs):
                return None
        else:
            if self.enable_caching:
                self._check_hasher(request)
            needs = [m.num_blocks_to_allocate(request, num_tokens, len(blocks))
                     for m, blocks in zip(managers, hit, strict=True)]
            # Cached hit blocks nobody holds stop being evictable once touched.
            if not self.pool.can_take(needs, hit):
                return None
            for blocks in hit:
                self.pool.touch(blocks)
        try:
            taken = self.pool.take_all(needs) if any(needs) else None
        except RuntimeError:
            # can_take said yes, so this is a bug; leave the books as they were.
            for m, blocks in zip(managers, hit or (), strict=False):
                self.pool.free(m.group_id, reversed(blocks))
            raise
        if hit is not None:
            for m, blocks in zip(managers, hit, strict=True):
                m.save_computed_blocks(request, blocks)
        if taken is not None:
            new = KVCacheBlocks(tuple(m.allocate(request, blocks)
                                      for m, blocks in zip(managers, taken, strict=True)))
        else:
            new = self._no_blocks
        if self.enable_caching:
            for m in managers:
                m.cache_blocks(request, num_to_cache)
            checkpoints = tuple((g, position, block.block_id)
                                for g, m in enumerate(managers)
                                for position, block in m.take_checkpoints(request.request_id))
            if checkpoints:
                new = KVCacheBlocks(new.blocks, checkpoints)
        self._quiet[request.request_id] = self._quiet_limits(request, num_computed)
        return new

    @property
    def replays_rejected_drafts(self) -> bool:
        """Whether a step that rejected drafts leaves the request computed only up to its
        known tokens (before the drafts): state groups cannot rewind a recurrent state, so
        the model runner restores the state saved there (the step's checkpoint at the known
        tokens) and the accepted drafts are computed again. Attention groups overwrite a
        rejected token's slot and need nothing."""
        return any(g.spec.is_state for g in self.config.groups)

    @property
    def saves_branch_points(self) -> bool:
        """Whether a state group saves checkpoints where requests' prompts part."""
        return self.enable_caching and any(m.saves_branch_points for m in self.managers)

    def want_checkpoint(self, request: KVRequest, position: int) -> None:
        """Another request's prompt leaves `request`'s at `position` tokens: state groups
        save a checkpoint there as `request` computes past it, so that the other request
        can hit it."""
        if not self.enable_caching:
            return
        for m in self.managers:
            m.want_checkpoint(request.request_id, position)
        self._quiet.pop(request.request_id, None)  # its next step may now save one

    def _quiet_limits(self, request: KVRequest, num_computed: int) -> tuple[int, int, int]:
        limits = [m.quiet_limits(request, num_computed) for m in self.managers]
        max_tokens = min(lim[0] for lim in limits)
        max_cache = min(lim[1] for lim in limits) if self.enable_caching else NEVER
        return max_tokens, max_cache, min(lim[2] for lim in limits)

    def free(self, request: KVRequest, *, num_valid_tokens: int | None = None) -> None:
        """Release every block of a finished or preempted request (cached ones stay
        hit-able until evicted). `num_valid_tokens`: only that many of its tokens had their
        KV written (a step failed); blocks past them were hashed for content that never
        arrived, so they leave the prefix cache unless another request holds them."""
        self._quiet.pop(request.request_id, None)
        for m in self.managers:
            stale = [] if num_valid_tokens is None else m.blocks_past(
                request.request_id, num_valid_tokens)
            m.free(request)
            if stale:
                self.pool.evict_blocks(m.group_id, stale)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return [m.block_ids(request_id) for m in self.managers]

    def new_step_starts(self) -> None:
        """Hook for per-step bookkeeping; the manager keeps none today."""

    @property
    def usage(self) -> float:
        """Fraction of the usable arena in blocks held by requests."""
        return self.pool.usage()

    def usage_per_group(self) -> list[float]:
        return [self.pool.group_usage(g) for g in range(self.num_groups)]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while requests hold blocks."""
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        return self.pool.take_events()

    def check_integrity(self) -> None:
        """Pool books consistent, and each block's ref count = the requests holding it."""
        self.pool.check_integrity()
        for m in self.managers:
            holders: dict[int, int] = {}
            for blocks in m.holdings():
                for b in blocks:
                    assert b.group_id == m.group_id, "a request holds another group's block"
                    if b.block_id:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
            for block_id, count in holders.items():
                ref = m.pool.groups[m.group_id].blocks[block_id].ref_cnt
                assert ref == count, f"group {m.group_id} block {block_id}: ref {ref} != " \
                                     f"{count} holders"
            assert m.pool.groups[m.group_id].num_used == len(holders), \
                f"group {m.group_id}: used blocks nobody holds"
