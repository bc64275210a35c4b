"""Blocks over the large-page arena: ref counts, prefix-cache index, page moves.

Every large page is free (in the arena) or owned by one group. A block of an owned page is

    used    ref_cnt > 0                       (held by requests)
    cached  ref_cnt == 0, block_hash set      (in the group's LRU queue, still hit-able)
    empty   ref_cnt == 0, no hash             (in its page's `empty` list)

    arena free pages ──assign──> group page ──all blocks empty──> back to the arena
                                     │  num_used == 0 but some cached: "unused" page; another
                                     └─ group short of pages evicts its cached blocks and takes it

Allocation for a group takes, in order: empty blocks of its own pages (fill partly used pages
first), whole free pages from the arena, then what the eviction policy (eviction.py) picks:
its own least recently used cached blocks or an unused page of another group. The pool is the
books that loop reads and changes. `can_take` answers, exactly and with no side effect,
whether a set of per-group demands fits (the policy runs the same loop on a trial view);
`take` is all or nothing.

Block and LargePage objects are made when a page is first handed out (to a group), so building
a pool costs O(large pages) whatever the block count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast, overload

from hybridkv.kv.events import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    stored_runs,
)
from hybridkv.kv.eviction import EvictionPolicy, make_eviction_policy
from hybridkv.kv.hashing import BlockHash
from hybridkv.kv.integrity import check_pool
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


# Stands for an empty `LargePage.empty` list; immutable, so nothing can push into it by
# mistake (`_push_empty` replaces it with a list).
_NO_EMPTY: list[Block] = cast("list[Block]", ())


class LargePage:
    """One large page. It holds no reference to its blocks (the pool keeps them, see
    `BlockPool.blocks_of`), so pages and blocks form no reference cycle and a dropped pool is
    freed at once by reference counting, not left to the cyclic garbage collector."""

    __slots__ = ("index", "group_id", "num_used", "num_hashed", "empty")

    def __init__(self, index: int) -> None:
        self.index = index
        self.group_id: int | None = None
        self.num_used = 0  # blocks with ref_cnt > 0
        self.num_hashed = 0  # blocks with a hash (used or cached)
        # Empty blocks of the owner group, popped from the end (lowest slot last pushed).
        # A shared empty tuple until the first is pushed: one object less per page made while
        # requests are admitted, for the garbage collector to count and walk.
        self.empty: list[Block] = _NO_EMPTY


@dataclass(frozen=True)
class BlockStored:
    group_id: int
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    group_id: int
    block_hashes: tuple[BlockHash, ...]


class GroupBooks:
    """The pool's books for one group."""

    def __init__(self, group_id: int, blocks_per_page: int, pages: list[LargePage | None],
                 single_blocks: list[Block | None],
                 page_blocks: list[list[Block] | None]) -> None:
        self.group_id = group_id
        self.blocks_per_page = blocks_per_page
        self.num_arena_pages = len(pages)
        # Block id = page index * blocks_per_page + slot, so a block id is an index into the
        # group's view of the arena. Block objects are made when a page is first handed to a
        # group (construction costs O(1) per page) and kept in the pool's lists, which the
        # books share (they hold no reference to the pool: no reference cycle).
        self._pages = pages
        self._single_blocks = single_blocks
        self._page_blocks = page_blocks
        # Large page 0 is never owned: every group keeps its own blocks there (the null block).
        page0 = pages[0]
        assert page0 is not None
        self.null_page_blocks = [Block(slot, group_id, page0)
                                 for slot in range(blocks_per_page)]
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

    def block(self, block_id: int) -> Block:
        """A block by id; it must lie in a page the group owns (or be in the null page)."""
        page_index, slot = divmod(block_id, self.blocks_per_page)
        if page_index == 0:
            return self.null_page_blocks[slot]
        page = self._pages[page_index]
        if page is None or page.group_id != self.group_id:
            raise KeyError(f"block {block_id} of group {self.group_id}: the group does not "
                           f"own large page {page_index}")
        if self.blocks_per_page == 1:
            block = self._single_blocks[page_index]
            assert block is not None
            return block
        blocks = self._page_blocks[page_index]
        assert blocks is not None
        return blocks[slot]

    @property
    def blocks(self) -> _BlockIndex:
        """`blocks[block_id]` (or a slice of ids): the group's block objects by id."""
        return _BlockIndex(self)


class _BlockIndex:
    __slots__ = ("books",)

    def __init__(self, books: GroupBooks) -> None:
        self.books = books

    @overload
    def __getitem__(self, key: int) -> Block: ...

    @overload
    def __getitem__(self, key: slice) -> list[Block]: ...

    def __getitem__(self, key: int | slice) -> Block | list[Block]:
        if isinstance(key, slice):
            size = self.books.num_arena_pages * self.books.blocks_per_page
            return [self.books.block(i) for i in range(*key.indices(size))]
        return self.books.block(key)


class BlockPool:
    def __init__(self, config: KVCacheConfig, *, enable_caching: bool = True,
                 enable_events: bool = False,
                 eviction: str | EvictionPolicy = "lru") -> None:
        if config.num_large_pages < 2:
            raise ValueError("the arena needs at least 2 large pages (one for null blocks)")
        self.policy = (eviction if isinstance(eviction, EvictionPolicy)
                       else make_eviction_policy(eviction, config))
        self.config = config
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.events: list[BlockStored | BlockRemoved] = []
        # KV events for routers and indexers (kv/events.py), when someone listens (a list the
        # engine drains each step); None: off.
        self.kv_events: list[KVCacheEvent] | None = None
        # (group id, block id, hash) of every cached block evicted to make room or by a
        # reset, while a KV connector keeps it (a list): their bytes are still intact until
        # the next forward, so it can copy them to another tier first. Blocks dropped as
        # stale (`evict_blocks`) are not logged: their content was never written.
        self.eviction_log: list[tuple[int, int, BlockHash]] | None = None
        # LargePage objects are made when first handed out (see `page`); page 0 now.
        self.pages: list[LargePage | None] = [None] * config.num_large_pages
        self.pages[0] = LargePage(0)
        # Pop from the end: page 1 is handed out first.
        self.free_pages: list[int] = list(range(config.num_large_pages - 1, 0, -1))
        # A page's blocks, slot order, from when it is first handed out; kept while the page
        # is free and relabelled for the next owner with as many blocks per page (block ids
        # are the same). Laid out as one block (every group with one block per page shares
        # it, the hot path of equal block bytes): `single_blocks`; as more: `page_blocks`.
        self.single_blocks: list[Block | None] = [None] * config.num_large_pages
        self.page_blocks: list[list[Block] | None] = [None] * config.num_large_pages
        self.groups = [GroupBooks(g.group_id, g.blocks_per_large_page, self.pages,
                                  self.single_blocks, self.page_blocks)
                       for g in config.groups]
        # Block 0 of every group lies in large page 0, which no group ever owns.
        self.null_blocks = tuple(gs.null_page_blocks[0] for gs in self.groups)
        for block in self.null_blocks:
            block.ref_cnt = 1  # never freed, never cached

    @property
    def eviction(self) -> str:
        return self.policy.name

    def page(self, index: int) -> LargePage:
        page = self.pages[index]
        if page is None:
            page = self.pages[index] = LargePage(index)
        return page

    def blocks_of(self, page: LargePage) -> list[Block]:
        """The blocks of a page as last laid out (its owner's, if owned), slot order."""
        single = self.single_blocks[page.index]
        if single is not None:
            return [single]
        return self.page_blocks[page.index] or []

    def _lay_out(self, gs: GroupBooks, page: LargePage) -> list[Block]:
        """The group's blocks in a free page it is being handed (all empty), slot order.
        A page keeps its Block objects while free; the next owner with as many blocks per
        page relabels them (same ids), others make their own."""
        index, per_page, group_id = page.index, gs.blocks_per_page, gs.group_id
        if per_page == 1:
            block = self.single_blocks[index]
            if block is None:
                block = self.single_blocks[index] = Block(index, group_id, page)
                self.page_blocks[index] = None
            else:
                block.group_id = group_id
            return [block]
        blocks = self.page_blocks[index]
        if blocks is None or len(blocks) != per_page:
            first = index * per_page
            blocks = self.page_blocks[index] = [Block(first + slot, group_id, page)
                                                for slot in range(per_page)]
            self.single_blocks[index] = None
        elif blocks[0].group_id != group_id:
            for block in blocks:
                block.group_id = group_id
        return blocks

    # ---------------------------------------------------------------- questions
    @property
    def num_usable_pages(self) -> int:
        return self.config.num_large_pages - 1

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def num_free_blocks(self, group_id: int) -> int:
        """Blocks the group could get if it were the only one asking: exactly what one
        `take` for it can get, whatever the policy picks."""
        gs = self.groups[group_id]
        reclaimable = len(self.free_pages) + sum(
            h.num_unused_pages() for h in self.groups if h is not gs)
        return gs.num_empty + len(gs.lru) + reclaimable * gs.blocks_per_page

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> Block | None:
        return self.groups[group_id].cached.get(block_hash)

    def can_take(self, num_blocks: Sequence[int],
                 hit_blocks: Sequence[Sequence[Block]] = ()) -> bool:
        """Whether touching `hit_blocks` (per group) and then `take(g, num_blocks[g])` for
        every group in order succeed. Exact, and no side effects."""
        free_pages = len(self.free_pages)
        for gs, need in zip(self.groups, num_blocks, strict=True):
            if need > gs.num_empty:
                free_pages -= cdiv(need - gs.num_empty, gs.blocks_per_page)
        if free_pages >= 0:
            return True  # empty blocks and free pages suffice: nothing is evicted
        return self.policy.fits(self, num_blocks, hit_blocks)

    # ---------------------------------------------------------------- allocation
    def take(self, group_id: int, num_blocks: int) -> list[Block]:
        """`num_blocks` blocks for a group, each with ref_cnt 1. All or nothing: raises
        RuntimeError, with nothing changed, when they are not there."""
        gs = self.groups[group_id]
        if (num_blocks > gs.num_empty + len(self.free_pages) * gs.blocks_per_page
                and num_blocks > self.num_free_blocks(group_id)):
            raise RuntimeError(f"no block left to take: group {group_id} needs {num_blocks}, "
                               f"{self.num_free_blocks(group_id)} can be had")
        out: list[Block] = []
        # The policy's loop, inlined up to where it would evict: empty blocks, then free
        # pages (after these, any need left finds neither, so the policy decides the rest).
        need = num_blocks
        while need > 0 and gs.num_empty:
            need -= self.take_empty(group_id, need, out)
        if need > 0 and self.free_pages:
            need -= self.take_free_pages(group_id, need, out)
        if need > 0:
            taken = self.policy.take(self, group_id, need, out)
            assert taken, "num_free_blocks promised these blocks"
        gs.num_used += num_blocks
        return out

    def take_all(self, num_blocks: Sequence[int]) -> list[list[Block]]:
        """`take` for every group in order, all or nothing: if one group's take fails, the
        blocks the groups before it took go back (evicted content stays evicted)."""
        out: list[list[Block]] = []
        try:
            for group_id, n in enumerate(num_blocks):
                out.append(self.take(group_id, n) if n > 0 else [])
        except RuntimeError:
            for group_id, blocks in enumerate(out):
                self.free(group_id, reversed(blocks))
            raise
        return out

    # The books a policy's take loop works on (see eviction.Books).
    def num_empty(self, group_id: int) -> int:
        return self.groups[group_id].num_empty

    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def oldest_cached(self, group_id: int) -> Block | None:
        lru = self.groups[group_id].lru
        return next(iter(lru.values())) if lru else None

    def oldest_unused_page(self, group_id: int) -> LargePage | None:
        gs = self.groups[group_id]
        if gs.track_unused:
            return next(iter(gs.unused_pages.values())) if gs.unused_pages else None
        return next(iter(gs.lru.values())).page if gs.lru else None

    def page_value(self, group_id: int, page: LargePage) -> int:
        """Tokens of compute the cached blocks of a group's page spare."""
        assert page.group_id == group_id
        return sum(b.value for b in self.blocks_of(page) if b.block_hash is not None)

    def take_empty(self, group_id: int, num_blocks: int, out: list[Block]) -> int:
        """Empty blocks of the group's last opened page that is still open."""
        gs = self.groups[group_id]
        index, page = next(reversed(gs.open_pages.items()))
        empty = page.empty
        n = min(num_blocks, len(empty))
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
        return n

    def take_free_pages(self, group_id: int, num_blocks: int, out: list[Block]) -> int:
        gs = self.groups[group_id]
        per_page = gs.blocks_per_page
        num_pages = min(len(self.free_pages), cdiv(num_blocks, per_page))
        indices = self.free_pages[-num_pages:]
        del self.free_pages[-num_pages:]
        gs.num_pages += num_pages
        if per_page == 1:  # the common case of equal block bytes: a page is a block
            single = self.single_blocks
            for index in reversed(indices):
                block = single[index]
                if block is None:
                    [block] = self._lay_out(gs, self.page(index))
                else:
                    block.group_id = group_id  # relabel: the last owner may have been another
                block.ref_cnt = 1
                page = block.page
                page.group_id = group_id
                page.num_used = 1
                out.append(block)
            return num_pages
        need = num_blocks
        for index in reversed(indices):
            page = self.page(index)
            page.group_id = group_id
            blocks = self._lay_out(gs, page)
            n = min(per_page, need)
            need -= n
            for block in blocks[:n]:
                block.ref_cnt = 1
                out.append(block)
            page.num_used = n
            if n < per_page:
                page.empty = blocks[:n - 1:-1] if n else blocks[::-1]
                gs.num_empty += per_page - n
                gs.open_pages[index] = page
        return min(num_blocks, num_pages * per_page)

    def take_cached(self, group_id: int, num_blocks: int, out: list[Block]) -> int:
        """Evict the group's least recently used cached blocks and take them."""
        gs = self.groups[group_id]
        lru, cached, unused = gs.lru, gs.cached, gs.unused_pages
        track_unused = gs.track_unused
        removed: list[BlockHash] | None = (
            [] if self.enable_events or self.kv_events is not None else None)
        log = self.eviction_log
        n = min(num_blocks, len(lru))
        for _ in range(n):
            _, block = lru.popitem(last=False)
            block_hash: BlockHash = block.block_hash  # type: ignore[assignment]  # cached
            if removed is not None:
                removed.append(block_hash)
            if log is not None:
                log.append((group_id, block.block_id, block_hash))
            del cached[block_hash]
            block.block_hash = None
            block.ref_cnt = 1
            page = block.page
            page.num_hashed -= 1
            if track_unused and page.num_used == 0:
                del unused[page.index]
            page.num_used += 1
            out.append(block)
        if removed and self.enable_events:
            self.events.append(BlockRemoved(gs.group_id, tuple(removed)))
        if removed and self.kv_events is not None:
            self.kv_events.append(BlocksRemoved(gs.group_id, tuple(removed)))
        return n

    def reclaim_page(self, group_id: int) -> None:
        """Evict the cached blocks of the group's least recently used unused page and give
        the page back to the arena."""
        if not self.reclaim_pages(group_id, 1):
            raise RuntimeError(f"group {group_id} has no unused page to give")

    def reclaim_pages(self, group_id: int, num_pages: int) -> int:
        """`reclaim_page` up to `num_pages` times (while the group has unused pages); returns
        how many. The free list hands them out in the order they were reclaimed, as if each
        had been taken before the next was reclaimed."""
        gs = self.groups[group_id]
        free_pages = self.free_pages
        lru, unused = gs.lru, gs.unused_pages
        count = 0
        while count < num_pages:
            if gs.track_unused:
                if not unused:
                    break
                _, page = unused.popitem(last=False)
                for block in self.blocks_of(page):
                    if block.block_hash is not None:
                        self._evict(gs, block)
            else:
                if not lru:
                    break
                block = next(iter(lru.values()))
                page = block.page
                self._evict(gs, block)
            self._release_page(gs, page)
            count += 1
        if count > 1:
            free_pages[-count:] = free_pages[:-count - 1:-1]
        return count

    def _use(self, gs: GroupBooks, block: Block) -> None:
        """An empty block of an owned page (just evicted) becomes used."""
        block.ref_cnt = 1
        page = block.page
        if page.num_used == 0 and gs.track_unused:
            del gs.unused_pages[page.index]
        page.num_used += 1

    def _release_page(self, gs: GroupBooks, page: LargePage) -> None:
        """An owned page with no used and no cached block goes back to the arena."""
        gs.num_empty -= len(page.empty)
        gs.num_pages -= 1
        page.empty = _NO_EMPTY
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
                empty = page.empty
                if empty:
                    empty.append(block)
                else:
                    page.empty = [block]
                    open_pages[page.index] = page
                gs.num_empty += 1
            if page.num_used == 0:
                if page.num_hashed == 0:
                    self._release_page(gs, page)
                elif gs.track_unused:
                    unused[page.index] = page

    # ---------------------------------------------------------------- prefix cache
    def cache(self, block: Block, block_hash: BlockHash, value: int = 0, *,
              parent_hash: BlockHash | None = None, token_ids: Sequence[int] = ()) -> None:
        """Register a full, computed block under its hash (first block per hash wins);
        `value`: the tokens of compute a hit on it spares. `parent_hash` and `token_ids`
        (the block's own tokens) are for KV events."""
        gs = self.groups[block.group_id]
        if block.block_hash is not None or block_hash in gs.cached:
            return
        block.block_hash = block_hash
        block.value = value
        gs.cached[block_hash] = block
        block.page.num_hashed += 1
        if self.enable_events:
            self.events.append(BlockStored(gs.group_id, (block_hash,), (block.block_id,)))
        if self.kv_events is not None:
            self.kv_events.append(BlocksStored(gs.group_id, (block_hash,), parent_hash,
                                               tuple(token_ids), len(token_ids)))

    def cache_run(self, group_id: int, blocks: list[Block], start: int, end: int,
                  block_hashes: Sequence[BlockHash], stride: int, block_size: int = 0,
                  token_ids: Sequence[int] = ()) -> None:
        """`cache` for `blocks[start:end]`, whose hashes are `block_hashes[(i+1)*stride-1]`
        (the null block and duplicates of cached content are skipped). `token_ids`: the
        request's tokens, for KV events."""
        gs = self.groups[group_id]
        cached = gs.cached
        stored: list[tuple[BlockHash, int]] | None = [] if self.enable_events else None
        announced: list[int] | None = [] if self.kv_events is not None else None
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
            if announced is not None:
                announced.append(i)
        if stored:
            hashes, ids = zip(*stored, strict=True)
            self.events.append(BlockStored(group_id, hashes, ids))
        if announced and self.kv_events is not None:
            group_hashes = block_hashes if stride == 1 else block_hashes[stride - 1::stride]
            self.kv_events.extend(stored_runs(group_id, announced, group_hashes, token_ids,
                                              block_size))

    def _evict(self, gs: GroupBooks, block: Block, *, valid: bool = True) -> Block:
        """Forget a cached block with ref 0; it becomes empty (not yet in `page.empty`).
        `valid=False`: its content was never written (not logged for connectors)."""
        del gs.lru[block.block_id]
        block_hash = block.block_hash
        assert block_hash is not None
        if valid and self.eviction_log is not None:
            self.eviction_log.append((gs.group_id, block.block_id, block_hash))
        del gs.cached[block_hash]
        block.block_hash = None
        block.page.num_hashed -= 1
        if self.enable_events:
            self.events.append(BlockRemoved(gs.group_id, (block_hash,)))
        if self.kv_events is not None:
            self.kv_events.append(BlocksRemoved(gs.group_id, (block_hash,)))
        return block

    def _push_empty(self, gs: GroupBooks, block: Block) -> None:
        """An empty block of an owned page goes to its page's empty list."""
        page = block.page
        if page.empty:
            page.empty.append(block)
        else:
            page.empty = [block]
            gs.open_pages[page.index] = page
        gs.num_empty += 1

    def evict_blocks(self, group_id: int, blocks: Iterable[Block]) -> int:
        """Forget the given cached blocks that nobody holds (e.g. a tier found their
        content stale). Returns how many were evicted; held or uncached ones are skipped."""
        gs = self.groups[group_id]
        count = 0
        for block in blocks:
            if block.ref_cnt or block.block_hash is None or not block.block_id:
                continue
            self._evict(gs, block, valid=False)
            count += 1
            page = block.page
            self._push_empty(gs, block)
            if page.num_hashed == 0 and page.num_used == 0:
                self._release_page(gs, page)
        return count

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any request holds blocks."""
        if any(gs.num_used for gs in self.groups):
            return False
        # Announced as one AllBlocksCleared, not a removal per block.
        kv_events, self.kv_events = self.kv_events, None
        try:
            for gs in self.groups:
                for block in list(gs.lru.values()):
                    self._evict(gs, block)
                    self._push_empty(gs, block)
                for page in [p for p in self.pages
                             if p is not None and p.group_id == gs.group_id]:
                    self._release_page(gs, page)
        finally:
            self.kv_events = kv_events
        if kv_events is not None:
            kv_events.append(AllBlocksCleared())
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
        check_pool(self)
