"""Blocks over the large-page arena: ref counts, prefix-cache index, LRU eviction, page moves.

Every large page is free (in the arena) or owned by one group. A block of an owned page is

    used    ref_cnt > 0                       (held by requests)
    cached  ref_cnt == 0, block_hash set      (in the group's LRU queue, still hit-able)
    empty   ref_cnt == 0, no hash             (in its page's `empty` list)

    arena free pages ──assign──> group page ──all blocks empty──> back to the arena
                                     │  num_used == 0 but some cached: "unused" page; another
                                     └─ group short of pages evicts its cached blocks and takes it

Allocation for a group takes, in order: empty blocks of its own pages (fill partly used pages
first), whole free pages from the arena, its own least recently used cached blocks, and last
an unused page of another group (evicting that page's cached blocks). With `eviction="lru"`
the own cached blocks go first, then the first other group in order gives a page. With
`eviction="value"` the last two steps weigh what goes: each other group offers its least
recently used unused page, the group itself its least recently used cached block, and the one
whose cached blocks spare the fewest tokens of compute per byte goes. A block's value is the
prefix a hit through it reuses (its end position: a state checkpoint and the attention blocks
of the same prefix are worth the same tokens, so per byte a big state goes first unless its
prefix is much longer). Measured with `hybridkv bench prefix --compare-eviction`: equal or
slightly better than lru at workable budgets, worse when the budget thrashes. KVCacheManager
uses it for models with state layers and lru for attention-only ones. `can_take`
answers whether a set of per-group demands fits, with no side effect; `take` then cannot fail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.plan import KVCacheConfig
from hybridkv.kv.spec import cdiv


class Block:
    """One block of one group. Identity matters: a request holds the object."""

    __slots__ = ("block_id", "group_id", "page", "ref_cnt", "block_hash", "value")

    def __init__(self, block_id: int, group_id: int, page: LargePage) -> None:
        self.block_id = block_id
        self.group_id = group_id
        self.page = page
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Tokens of compute a hit on this cached block spares (eviction weighs it by bytes).
        self.value = 0

    def __repr__(self) -> str:
        return f"Block(g{self.group_id}:{self.block_id}, ref={self.ref_cnt})"


class LargePage:
    __slots__ = ("index", "group_id", "num_used", "num_hashed", "empty")

    def __init__(self, index: int) -> None:
        self.index = index
        self.group_id: int | None = None
        self.num_used = 0  # blocks with ref_cnt > 0
        self.num_hashed = 0  # blocks with a hash (used or cached)
        # Empty blocks of the owner group, popped from the end (lowest slot last pushed).
        self.empty: list[Block] = []


@dataclass(frozen=True)
class BlockStored:
    group_id: int
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    group_id: int
    block_hashes: tuple[BlockHash, ...]


class _GroupState:
    """The pool's books for one group."""

    def __init__(self, group_id: int, blocks_per_page: int, num_pages: int,
                 pages: list[LargePage]) -> None:
        self.group_id = group_id
        self.blocks_per_page = blocks_per_page
        # Block id = page index * blocks_per_page + slot, so a block id is an index into the
        # group's view of the arena.
        self.blocks = [Block(i, group_id, pages[i // blocks_per_page])
                       for i in range(num_pages * blocks_per_page)]
        self.open_pages: OrderedDict[int, LargePage] = OrderedDict()  # pages with empty blocks
        # Owned pages with num_used == 0, oldest first. With one block per page these are
        # exactly the pages of the LRU blocks, so only multi-block pages are tracked here.
        self.track_unused = blocks_per_page > 1
        self.unused_pages: OrderedDict[int, LargePage] = OrderedDict()
        self.lru: OrderedDict[int, Block] = OrderedDict()  # cached blocks, oldest first
        self.cached: dict[BlockHash, Block] = {}
        self.num_empty = 0
        self.num_used = 0
        self.num_pages = 0

    def num_unused_pages(self) -> int:
        return len(self.unused_pages) if self.track_unused else len(self.lru)


class BlockPool:
    def __init__(self, config: KVCacheConfig, *, enable_caching: bool = True,
                 enable_events: bool = False, eviction: str = "lru") -> None:
        if eviction not in ("value", "lru"):
            raise ValueError(f"unknown eviction policy {eviction!r}; accepted: value, lru")
        self.eviction = eviction
        if config.num_large_pages < 2:
            raise ValueError("the arena needs at least 2 large pages (one for null blocks)")
        self.config = config
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.events: list[BlockStored | BlockRemoved] = []
        self.pages = [LargePage(i) for i in range(config.num_large_pages)]
        # Pop from the end: page 1 is handed out first.
        self.free_pages: list[int] = list(range(config.num_large_pages - 1, 0, -1))
        self.groups = [_GroupState(g.group_id, g.blocks_per_large_page,
                                   config.num_large_pages, self.pages)
                       for g in config.groups]
        # Block 0 of every group lies in large page 0, which no group ever owns.
        self.null_blocks = tuple(gs.blocks[0] for gs in self.groups)
        for block in self.null_blocks:
            block.ref_cnt = 1  # never freed, never cached

    # ---------------------------------------------------------------- questions
    @property
    def num_usable_pages(self) -> int:
        return self.config.num_large_pages - 1

    def num_free_blocks(self, group_id: int) -> int:
        """Blocks the group could get if it were the only one asking."""
        gs = self.groups[group_id]
        reclaimable = len(self.free_pages) + sum(
            h.num_unused_pages() for h in self.groups if h is not gs)
        return gs.num_empty + len(gs.lru) + reclaimable * gs.blocks_per_page

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> Block | None:
        return self.groups[group_id].cached.get(block_hash)

    def can_take(self, num_blocks: Sequence[int], num_touched_cached: Sequence[int]) -> bool:
        """Whether `take(g, num_blocks[g])` for every group, after touching
        `num_touched_cached[g]` cached blocks, can succeed. No side effects.

        Replays `take`'s order on counts, pessimistically where `take`'s choice of block
        matters (an evicted or touched block is assumed to make an unused page used)."""
        free_pages = len(self.free_pages)
        fast = True
        for gs, need in zip(self.groups, num_blocks, strict=True):
            if need > gs.num_empty:
                fast = False
                free_pages -= cdiv(need - gs.num_empty, gs.blocks_per_page)
        if fast or free_pages >= 0:
            return True
        return self._can_take_slow(num_blocks, num_touched_cached)

    def _can_take_slow(self, num_blocks: Sequence[int],
                       num_touched_cached: Sequence[int]) -> bool:
        free_pages = len(self.free_pages)
        empty = [gs.num_empty for gs in self.groups]
        cached = [len(gs.lru) - t for gs, t in zip(self.groups, num_touched_cached, strict=True)]
        unused = [max(0, gs.num_unused_pages() - t)
                  for gs, t in zip(self.groups, num_touched_cached, strict=True)]
        for g, need in enumerate(num_blocks):
            if need <= 0:
                continue
            per_page = self.groups[g].blocks_per_page
            n = min(need, empty[g])
            need -= n
            empty[g] -= n
            unused[g] = max(0, unused[g] - n)
            pages = min(free_pages, cdiv(need, per_page))
            free_pages -= pages
            need = max(0, need - pages * per_page)
            if self.eviction == "value":
                # Own cached blocks and other groups' pages may go in any mix: enough of
                # both together, and every other group may lose as many pages as could go.
                if need > cached[g] + per_page * sum(
                        unused[h] for h in range(len(self.groups)) if h != g):
                    return False
                n = min(need, cached[g])
                cached[g] -= n
                unused[g] = max(0, unused[g] - n)
                pages = cdiv(need, per_page)
                for h, gs in enumerate(self.groups):
                    if h != g:
                        n = min(pages, unused[h])
                        unused[h] -= n
                        cached[h] = max(0, cached[h] - n * gs.blocks_per_page)
                        empty[h] = max(0, empty[h] - n * gs.blocks_per_page)
                continue
            n = min(need, cached[g])
            need -= n
            cached[g] -= n
            unused[g] = max(0, unused[g] - n)
            pages = cdiv(need, per_page)
            if not pages:
                continue
            if sum(unused[h] for h in range(len(self.groups)) if h != g) < pages:
                return False
            for h, gs in enumerate(self.groups):
                if h == g:
                    continue
                n = min(pages, unused[h])  # `take` reclaims in this very order
                unused[h] -= n
                cached[h] = max(0, cached[h] - n * gs.blocks_per_page)
                empty[h] = max(0, empty[h] - n * gs.blocks_per_page)
                pages -= n
        return True

    # ---------------------------------------------------------------- allocation
    def take(self, group_id: int, num_blocks: int) -> list[Block]:
        """`num_blocks` blocks for a group, each with ref_cnt 1. Check `can_take` first."""
        gs = self.groups[group_id]
        out: list[Block] = []
        while len(out) < num_blocks:
            need = num_blocks - len(out)
            if gs.open_pages:
                self._take_empty(gs, need, out)
            elif self.free_pages:
                self._take_free_pages(gs, need, out)
            elif self.eviction == "lru" and gs.lru:
                self._take_evicted(gs, need, out)
            elif self.eviction == "value" and gs.lru and not self._page_cheaper_than_own(gs):
                self._take_evicted(gs, 1, out)  # weigh again before the next one
            else:
                self._reclaim_page(gs)  # to the arena; the next turn takes it
        gs.num_used += num_blocks
        return out

    def _take_empty(self, gs: _GroupState, need: int, out: list[Block]) -> None:
        index, page = next(reversed(gs.open_pages.items()))
        empty = page.empty
        n = min(need, len(empty))
        taken = empty[-n:]
        del empty[-n:]
        for block in taken:
            block.ref_cnt = 1
        out.extend(reversed(taken))
        gs.num_empty -= n
        if page.num_used == 0 and gs.track_unused:
            del gs.unused_pages[index]
        page.num_used += n
        if not empty:
            del gs.open_pages[index]

    def _take_free_pages(self, gs: _GroupState, need: int, out: list[Block]) -> None:
        per_page = gs.blocks_per_page
        num_pages = min(len(self.free_pages), cdiv(need, per_page))
        indices = self.free_pages[-num_pages:]
        del self.free_pages[-num_pages:]
        gs.num_pages += num_pages
        blocks = gs.blocks
        group_id = gs.group_id
        pages = self.pages
        if per_page == 1:  # the common case of equal block bytes: a page is a block
            for index in reversed(indices):
                page = pages[index]
                page.group_id = group_id
                page.num_used = 1
                block = blocks[index]
                block.ref_cnt = 1
                out.append(block)
            return
        for index in reversed(indices):
            page = pages[index]
            page.group_id = group_id
            n = min(per_page, need)
            need -= n
            first = index * per_page
            for block in blocks[first:first + n]:
                block.ref_cnt = 1
                out.append(block)
            page.num_used = n
            if n < per_page:
                page.empty = blocks[first + per_page - 1:first + n - 1:-1]
                gs.num_empty += per_page - n
                gs.open_pages[index] = page

    def _take_evicted(self, gs: _GroupState, need: int, out: list[Block]) -> None:
        """Evict the group's least recently used cached blocks and take them."""
        lru, cached, unused = gs.lru, gs.cached, gs.unused_pages
        track_unused = gs.track_unused
        removed: list[BlockHash] | None = [] if self.enable_events else None
        for _ in range(min(need, len(lru))):
            _, block = lru.popitem(last=False)
            block_hash: BlockHash = block.block_hash  # type: ignore[assignment]  # cached
            if removed is not None:
                removed.append(block_hash)
            del cached[block_hash]
            block.block_hash = None
            block.ref_cnt = 1
            page = block.page
            page.num_hashed -= 1
            if track_unused and page.num_used == 0:
                del unused[page.index]
            page.num_used += 1
            out.append(block)
        if removed:
            self.events.append(BlockRemoved(gs.group_id, tuple(removed)))

    def _use(self, gs: _GroupState, block: Block) -> None:
        """An empty block of an owned page (just evicted) becomes used."""
        block.ref_cnt = 1
        page = block.page
        if page.num_used == 0 and gs.track_unused:
            del gs.unused_pages[page.index]
        page.num_used += 1

    def _candidate_page(self, gs: _GroupState) -> tuple[float, _GroupState, LargePage] | None:
        """(value, group, page) of the unused page of another group to reclaim: the first
        group's least recently used one (lru), or the least valuable of those (value)."""
        best: tuple[float, _GroupState, LargePage] | None = None
        for other in self.groups:
            if other is gs or not other.num_unused_pages():
                continue
            if other.track_unused:
                page = next(iter(other.unused_pages.values()))
            else:
                page = next(iter(other.lru.values())).page
            if self.eviction == "lru":
                return 0.0, other, page
            first = page.index * other.blocks_per_page
            value = sum(b.value for b in other.blocks[first:first + other.blocks_per_page]
                        if b.block_hash is not None)
            if best is None or value < best[0]:  # pages have equal bytes: compare values
                best = (value, other, page)
        return best

    def _page_cheaper_than_own(self, gs: _GroupState) -> bool:
        """Whether another group's page spares fewer tokens per byte than the group's own
        least recently used cached block."""
        candidate = self._candidate_page(gs)
        if candidate is None:
            return False
        own = next(iter(gs.lru.values()))
        own_density = own.value / self.config.groups[gs.group_id].block_bytes
        return candidate[0] / self.config.large_page_bytes < own_density

    def _reclaim_page(self, gs: _GroupState) -> None:
        """Evict the cached blocks of another group's unused page and free it."""
        best = self._candidate_page(gs)
        if best is None:
            raise RuntimeError("no block left to take: call can_take() before take()")
        _, other, page = best
        if other.track_unused:
            del other.unused_pages[page.index]
        first = page.index * other.blocks_per_page
        for block in other.blocks[first:first + other.blocks_per_page]:
            if block.block_hash is not None:
                self._evict(other, block)
        self._release_page(other, page)

    def _release_page(self, gs: _GroupState, page: LargePage) -> None:
        """An owned page with no used and no cached block goes back to the arena."""
        gs.num_empty -= len(page.empty)
        gs.num_pages -= 1
        page.empty = []
        page.group_id = None
        gs.open_pages.pop(page.index, None)
        gs.unused_pages.pop(page.index, None)
        self.free_pages.append(page.index)

    # ---------------------------------------------------------------- ref counts
    def touch(self, blocks: Iterable[Block]) -> None:
        """Requests start sharing these blocks (prefix hits); cached ones leave the LRU."""
        for block in blocks:
            if not block.block_id:
                continue  # the null block
            if block.ref_cnt == 0:
                gs = self.groups[block.group_id]
                del gs.lru[block.block_id]
                self._use(gs, block)
                gs.num_used += 1
            else:
                block.ref_cnt += 1

    def free(self, group_id: int, blocks: Iterable[Block]) -> None:
        """Drop one reference from each of a group's blocks. Give them in eviction order: the
        first block to reach ref 0 is the first evicted among them (callers pass a request's
        blocks last-first, so a shared prefix's head outlives its tail)."""
        gs = self.groups[group_id]
        lru, unused, open_pages = gs.lru, gs.unused_pages, gs.open_pages
        for block in blocks:
            if not block.block_id:
                continue  # the null block
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            gs.num_used -= 1
            page = block.page
            page.num_used -= 1
            if block.block_hash is not None:
                lru[block.block_id] = block
            else:
                page.empty.append(block)
                gs.num_empty += 1
                if len(page.empty) == 1:
                    open_pages[page.index] = page
            if page.num_used == 0:
                if page.num_hashed == 0:
                    self._release_page(gs, page)
                elif gs.track_unused:
                    unused[page.index] = page

    # ---------------------------------------------------------------- prefix cache
    def cache(self, block: Block, block_hash: BlockHash, value: int = 0) -> None:
        """Register a full, computed block under its hash (first block per hash wins);
        `value`: the tokens of compute a hit on it spares."""
        gs = self.groups[block.group_id]
        if block.block_hash is not None or block_hash in gs.cached:
            return
        block.block_hash = block_hash
        block.value = value
        gs.cached[block_hash] = block
        block.page.num_hashed += 1
        if self.enable_events:
            self.events.append(BlockStored(gs.group_id, (block_hash,), (block.block_id,)))

    def cache_run(self, group_id: int, blocks: list[Block], start: int, end: int,
                  block_hashes: Sequence[BlockHash], stride: int, block_size: int = 0) -> None:
        """`cache` for `blocks[start:end]`, whose hashes are `block_hashes[(i+1)*stride-1]`
        (the null block and duplicates of cached content are skipped)."""
        gs = self.groups[group_id]
        cached = gs.cached
        stored: list[tuple[BlockHash, int]] | None = [] if self.enable_events else None
        for i in range(start, end):
            block = blocks[i]
            if not block.block_id or block.block_hash is not None:
                continue
            block_hash = block_hashes[(i + 1) * stride - 1]
            if block_hash in cached:
                continue
            block.block_hash = block_hash
            block.value = (i + 1) * block_size  # every hit through it reuses this prefix
            cached[block_hash] = block
            block.page.num_hashed += 1
            if stored is not None:
                stored.append((block_hash, block.block_id))
        if stored:
            hashes, ids = zip(*stored, strict=True)
            self.events.append(BlockStored(group_id, hashes, ids))

    def _evict(self, gs: _GroupState, block: Block) -> Block:
        """Forget a cached block with ref 0; it becomes empty (not yet in `page.empty`)."""
        del gs.lru[block.block_id]
        block_hash = block.block_hash
        assert block_hash is not None
        del gs.cached[block_hash]
        block.block_hash = None
        block.page.num_hashed -= 1
        if self.enable_events:
            self.events.append(BlockRemoved(gs.group_id, (block_hash,)))
        return block

    def evict_blocks(self, group_id: int, blocks: Iterable[Block]) -> int:
        """Forget the given cached blocks that nobody holds (e.g. a tier found their
        content stale). Returns how many were evicted; held or uncached ones are skipped."""
        gs = self.groups[group_id]
        count = 0
        for block in blocks:
            if block.ref_cnt or block.block_hash is None or not block.block_id:
                continue
            self._evict(gs, block)
            count += 1
            page = block.page
            page.empty.append(block)
            gs.num_empty += 1
            if len(page.empty) == 1:
                gs.open_pages[page.index] = page
            if page.num_hashed == 0 and page.num_used == 0:
                self._release_page(gs, page)
        return count

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any request holds blocks."""
        if any(gs.num_used for gs in self.groups):
            return False
        for gs in self.groups:
            for block in list(gs.lru.values()):
                self._evict(gs, block)
                block.page.empty.append(block)
                gs.num_empty += 1
            for page in [p for p in self.pages if p.group_id == gs.group_id]:
                self._release_page(gs, page)
        return True

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        events, self.events = self.events, []
        return events

    # ---------------------------------------------------------------- accounting
    def num_used_blocks(self, group_id: int) -> int:
        return self.groups[group_id].num_used

    def usage(self) -> float:
        """Bytes in used blocks / usable arena bytes."""
        used = sum(gs.num_used * g.block_bytes
                   for gs, g in zip(self.groups, self.config.groups, strict=True))
        return used / (self.num_usable_pages * self.config.large_page_bytes)

    def group_usage(self, group_id: int) -> float:
        g = self.config.groups[group_id]
        return (self.groups[group_id].num_used * g.block_bytes
                / (self.num_usable_pages * self.config.large_page_bytes))

    def check_integrity(self) -> None:
        """Recount everything from the blocks themselves; raise AssertionError on a mismatch."""
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages), "a page is twice in the free list"
        assert 0 not in free, "the null page is in the free list"
        for block in self.null_blocks:
            assert block.ref_cnt >= 1 and block.block_hash is None, "null block changed"
        for page in self.pages[1:]:
            if page.index in free:
                assert page.group_id is None and not page.empty, f"free page {page.index} owned"
                continue
            assert page.group_id is not None, f"page {page.index} neither free nor owned"
            self._check_page(page)
        for gs in self.groups:
            owned = [p for p in self.pages[1:] if p.group_id == gs.group_id]
            assert gs.num_pages == len(owned), f"group {gs.group_id} page count"
            assert gs.num_empty == sum(len(p.empty) for p in owned), "empty count"
            assert set(gs.open_pages) == {p.index for p in owned if p.empty}, "open pages"
            unused = {p.index for p in owned if p.num_used == 0}
            if gs.track_unused:
                assert set(gs.unused_pages) == unused, "unused pages"
            else:
                assert not gs.unused_pages, "untracked unused pages"
                assert unused == {b.page.index for b in gs.lru.values()}, "unused pages"
            per_page = gs.blocks_per_page
            blocks = [b for p in owned for b in gs.blocks[p.index * per_page:
                                                           (p.index + 1) * per_page]]
            assert gs.num_used == sum(b.ref_cnt > 0 for b in blocks), "used count"
            lru = {b.block_id for b in blocks if b.ref_cnt == 0 and b.block_hash is not None}
            assert set(gs.lru) == lru, f"group {gs.group_id} LRU holds the wrong blocks"
            hashed = {b.block_hash: b for b in blocks if b.block_hash is not None}
            assert len(hashed) == sum(b.block_hash is not None for b in blocks), "dup hash"
            assert gs.cached == hashed, f"group {gs.group_id} hash index mismatch"

    def _check_page(self, page: LargePage) -> None:
        assert page.group_id is not None
        gs = self.groups[page.group_id]
        per_page = gs.blocks_per_page
        blocks = gs.blocks[page.index * per_page:(page.index + 1) * per_page]
        assert all(b.ref_cnt >= 0 for b in blocks), "negative ref count"
        assert page.num_used == sum(b.ref_cnt > 0 for b in blocks), f"page {page.index} used"
        assert page.num_hashed == sum(b.block_hash is not None for b in blocks), "hashed"
        empty = [b for b in blocks if b.ref_cnt == 0 and b.block_hash is None]
        assert sorted(b.block_id for b in page.empty) == sorted(b.block_id for b in empty), \
            f"page {page.index} empty list"
        assert page.num_used or page.num_hashed, f"page {page.index} all empty but owned"
