"""Eviction policies: what goes next when a group needs more blocks than are free.

A group's take draws, in order, from empty blocks of its own pages (partly used pages first),
whole free pages of the arena, and then, one decision at a time, from what its policy picks:

    next_victim(books, g) -> g       the group's own least recently used cached block(s)
                          -> h != g  group h's least recently used unused page (evicted whole,
                                     back to the arena, then taken as a free page)
                          -> None    nothing left: the take cannot succeed

`take` runs that loop on the pool's books. `fits` touches the hit blocks and runs the very
same loop for every group in order on `TrialBooks`, a view of the books that records what the
trial would touch, evict and take without changing the pool. So `can_take` answers yes exactly
when the takes that follow succeed, whatever blocks the policy picks.

    lru    own cached blocks first (all that are needed at once), then the first other group
           in order that has an unused page.
    value  each step weighs the group's own least recently used cached block against the
           least valuable unused page that another group offers; the one that spares the
           fewest tokens of compute per byte goes. A block's value is the prefix a hit
           through it reuses (its end position): a state checkpoint and the attention blocks
           of the same prefix are worth the same tokens, so per byte a big state goes first
           unless its prefix is much longer. Measured with `hybridkv bench prefix
           --compare-eviction`: equal or slightly better than lru at workable budgets, worse
           when the budget thrashes. KVCacheManager uses it for models with state layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

from hybridkv.kv.spec import cdiv

if TYPE_CHECKING:
    from hybridkv.kv.block_pool import Block, BlockPool, GroupBooks, LargePage
    from hybridkv.kv.plan import KVCacheConfig


class Books(Protocol):
    """What a take reads and changes: the pool itself, or a trial view of it."""

    @property
    def num_groups(self) -> int: ...

    def num_empty(self, group_id: int) -> int: ...

    def num_free_pages(self) -> int: ...

    def take_empty(self, group_id: int, num_blocks: int, out: list[Block]) -> int: ...

    def take_free_pages(self, group_id: int, num_blocks: int, out: list[Block]) -> int: ...

    def take_cached(self, group_id: int, num_blocks: int, out: list[Block]) -> int: ...

    def oldest_cached(self, group_id: int) -> Block | None: ...

    def oldest_unused_page(self, group_id: int) -> LargePage | None: ...

    def page_value(self, group_id: int, page: LargePage) -> int: ...

    def reclaim_page(self, group_id: int) -> None: ...

    def reclaim_pages(self, group_id: int, num_pages: int) -> int: ...


class EvictionPolicy:
    """Decides what a group short of blocks evicts; `take` and `fits` share the decisions."""

    name: ClassVar[str] = "base"

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config

    def next_victim(self, books: Books, group_id: int) -> int | None:
        """The group that gives way next (see the module docstring)."""
        raise NotImplementedError

    def own_batch(self, num_blocks: int) -> int:
        """How many own cached blocks to evict before deciding again."""
        return num_blocks

    def page_batch(self, group_id: int, num_blocks: int) -> int:
        """How many unused pages of the victim group to reclaim before deciding again."""
        return 1

    def take(self, books: Books, group_id: int, num_blocks: int, out: list[Block]) -> bool:
        """Take `num_blocks` for a group from `books`; False once nothing is left (the pool
        checks before it calls this, so on the real books it never returns False)."""
        num_empty, num_free_pages = books.num_empty, books.num_free_pages
        while num_blocks > 0:
            if num_empty(group_id):
                num_blocks -= books.take_empty(group_id, num_blocks, out)
            elif num_free_pages():
                num_blocks -= books.take_free_pages(group_id, num_blocks, out)
            else:
                victim = self.next_victim(books, group_id)
                if victim is None:
                    return False
                if victim == group_id:
                    num_blocks -= books.take_cached(group_id, self.own_batch(num_blocks), out)
                else:  # to the arena; the next turn takes them
                    books.reclaim_pages(victim, self.page_batch(group_id, num_blocks))
        return True

    def fits(self, pool: BlockPool, num_blocks: Sequence[int],
             hit_blocks: Sequence[Sequence[Block]]) -> bool:
        """Whether touching `hit_blocks` and then taking `num_blocks[g]` for every group in
        order succeeds. No side effect on the pool. Counts settle most cases; the trial runs
        only where the policy's choice of blocks can decide."""
        answer = answer_from_counts(pool, num_blocks, hit_blocks)
        if answer is not None:
            return answer
        return self.fits_by_trial(pool, num_blocks, hit_blocks)

    def fits_by_trial(self, pool: BlockPool, num_blocks: Sequence[int],
                      hit_blocks: Sequence[Sequence[Block]]) -> bool:
        """`fits` by running the takes on a trial view of the books: O(blocks taken)."""
        trial = TrialBooks(pool)
        for blocks in hit_blocks:
            trial.touch(blocks)
        scratch: list[Block] = []
        return all(self.take(trial, g, n, scratch) for g, n in enumerate(num_blocks) if n > 0)


class LRUEviction(EvictionPolicy):
    name = "lru"

    def __init__(self, config: KVCacheConfig) -> None:
        super().__init__(config)
        self.blocks_per_page = [g.blocks_per_large_page for g in config.groups]

    def page_batch(self, group_id: int, num_blocks: int) -> int:
        # Reclaiming a page changes neither the group's own cached blocks nor which other
        # group comes first with an unused page: the next decisions would pick the same
        # group again until the need is met or it has none left.
        return cdiv(num_blocks, self.blocks_per_page[group_id])

    def next_victim(self, books: Books, group_id: int) -> int | None:
        if books.oldest_cached(group_id) is not None:
            return group_id
        for h in range(books.num_groups):
            if h != group_id and books.oldest_unused_page(h) is not None:
                return h
        return None


class ValueEviction(EvictionPolicy):
    name = "value"

    def __init__(self, config: KVCacheConfig) -> None:
        super().__init__(config)
        self.block_bytes = [g.block_bytes for g in config.groups]

    def own_batch(self, num_blocks: int) -> int:
        return 1  # weigh again before the next one

    def next_victim(self, books: Books, group_id: int) -> int | None:
        best: int | None = None
        best_value = 0
        for h in range(books.num_groups):
            if h == group_id:
                continue
            page = books.oldest_unused_page(h)
            if page is None:
                continue
            value = books.page_value(h, page)
            if best is None or value < best_value:  # pages have equal bytes: compare values
                best, best_value = h, value
        own = books.oldest_cached(group_id)
        if own is None:
            return best
        if best is not None and (best_value / self.config.large_page_bytes
                                 < own.value / self.block_bytes[group_id]):
            return best
        return group_id


def answer_from_counts(pool: BlockPool, num_blocks: Sequence[int],
                       hit_blocks: Sequence[Sequence[Block]]) -> bool | None:
    """Yes or no where counts decide whatever the policy picks; None where they do not.

    A group's supply is its empty and cached blocks plus `blocks_per_page` for each free page
    and each unused page of another group: exactly what one take can get. A group f that takes
    n blocks "spends" pages others could have had, and each spent page costs a later group g
    `blocks_per_page[g]` of its supply:
        one block per page   every block spends exactly one page (a free one, an unused page
                             of another group, or its own cached block's page), so n pages
        more per page        between 0 (its own empty or cached blocks in used pages) and
                             ceil(n / blocks_per_page) + min(n, its unused pages)
    Supply minus the fewest pages spent before g is below g's demand: a sure no. Supply minus
    the most pages spent covers every demand: a sure yes. With one block per page in every
    group (equal block bytes) the two meet, so counts always decide.
    """
    groups = pool.groups
    free = len(pool.free_pages)
    cached = [len(gs.lru) for gs in groups]
    unused = [gs.num_unused_pages() for gs in groups]
    if not any(hit_blocks):
        return _count(groups, free, num_blocks, cached, unused, unused)
    # Touching a hit block only lowers counts (by one at most per block): bounds settle most
    # cases without looking at the blocks. Lowest counts and a sure yes: yes.
    low_cached = [max(0, c - len(b)) for c, b in zip(cached, hit_blocks, strict=False)]
    low_unused = [max(0, u - len(b)) for u, b in zip(unused, hit_blocks, strict=False)]
    low_cached += cached[len(low_cached):]
    low_unused += unused[len(low_unused):]
    if _count(groups, free, num_blocks, low_cached, low_unused, unused):
        return True
    # Counts as they are (nothing touched) and a sure no: no.
    if _count(groups, free, num_blocks, cached, unused, unused) is False:
        return False
    for g, blocks in enumerate(hit_blocks):
        if not blocks:
            continue
        # Touched: cached blocks nobody holds (each once), and with them their pages where
        # no block of the page is used (one block per page: the page is the block).
        touched = {b.block_id: b for b in blocks if not b.ref_cnt and b.block_id}
        cached[g] -= len(touched)
        if groups[g].track_unused:
            unused[g] -= len({b.page.index for b in touched.values() if not b.page.num_used})
        else:
            unused[g] -= len(touched)
    return _count(groups, free, num_blocks, cached, unused, unused)


def _count(groups: Sequence[GroupBooks], free: int, num_blocks: Sequence[int],
           cached: Sequence[int], unused: Sequence[int],
           most_unused: Sequence[int]) -> bool | None:
    """`answer_from_counts` on given cached and unused counts per group (`most_unused`: an
    upper bound of `unused`, for the most pages a group may spend)."""
    total_unused = sum(unused)
    fewest = most = 0  # pages spent by the groups before
    sure = True
    for g, need in enumerate(num_blocks):
        if need <= 0:
            continue
        gs = groups[g]
        per_page = gs.blocks_per_page
        supply = gs.num_empty + cached[g] + per_page * (free + total_unused - unused[g])
        if need > supply - per_page * fewest:
            return False
        if need > supply - per_page * most:
            sure = False
        if per_page == 1:
            fewest += need
            most += need
        else:
            most += cdiv(need, per_page) + min(need, most_unused[g])
    return True if sure else None


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUEviction, "value": ValueEviction}


def make_eviction_policy(name: str, config: KVCacheConfig) -> EvictionPolicy:
    try:
        return POLICIES[name](config)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; accepted: "
                         f"{', '.join(sorted(POLICIES, reverse=True))}") from None


class _TrialGroup:
    """One group's changes in a trial. Sets only grow, so the oldest remaining cached block
    and unused page are found by iterators that only move forward."""

    __slots__ = ("books", "num_empty", "evicted", "used", "gone", "taken", "_lru", "_lru_head",
                 "_unused", "_unused_head")

    def __init__(self, books: GroupBooks) -> None:
        self.books = books
        self.num_empty = books.num_empty
        self.evicted: set[int] = set()  # block ids out of the LRU (touched, taken, evicted)
        self.used: set[int] = set()  # page indices that hold a used block now
        self.gone: set[int] = set()  # page indices reclaimed by another group
        self.taken: dict[int, int] = {}  # page index -> empty blocks taken from it
        self._lru: Iterator[Block] | None = None
        self._lru_head: Block | None = None
        self._unused: Iterator[LargePage] | None = None
        self._unused_head: LargePage | None = None

    def oldest_cached(self) -> Block | None:
        if self._lru is None:
            self._lru = iter(self.books.lru.values())
            self._lru_head = next(self._lru, None)
        block = self._lru_head
        while block is not None and block.block_id in self.evicted:
            block = next(self._lru, None)
        self._lru_head = block
        return block

    def oldest_unused_page(self) -> LargePage | None:
        if not self.books.track_unused:
            # One block per page: the unused pages are exactly the pages of cached blocks.
            block = self.oldest_cached()
            return None if block is None else block.page
        if self._unused is None:
            self._unused = iter(self.books.unused_pages.values())
            self._unused_head = next(self._unused, None)
        page = self._unused_head
        while page is not None and (page.index in self.used or page.index in self.gone):
            page = next(self._unused, None)
        self._unused_head = page
        return page


class TrialBooks:
    """The pool's books as a trial sees them: reads go to the pool, changes stay here."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.free = len(pool.free_pages)
        self.groups = [_TrialGroup(gs) for gs in pool.groups]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def touch(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            t = self.groups[block.group_id]
            if block.block_id and block.ref_cnt == 0 and block.block_id not in t.evicted:
                t.evicted.add(block.block_id)
                t.used.add(block.page.index)

    def num_empty(self, group_id: int) -> int:
        return self.groups[group_id].num_empty

    def num_free_pages(self) -> int:
        return self.free

    def take_empty(self, group_id: int, num_blocks: int, out: list[Block]) -> int:
        # The pool takes from its last open page until it is empty, then the one before.
        t = self.groups[group_id]
        got = 0
        for page in reversed(t.books.open_pages.values()):
            if got == num_blocks:
                break
            if page.index in t.gone:
                continue
            n = min(num_blocks - got, len(page.empty) - t.taken.get(page.index, 0))
            if n > 0:
                t.taken[page.index] = t.taken.get(page.index, 0) + n
                t.used.add(page.index)
                got += n
        t.num_empty -= got
        return got

    def take_free_pages(self, group_id: int, num_blocks: int, out: list[Block]) -> int:
        t = self.groups[group_id]
        per_page = t.books.blocks_per_page
        num_pages = min(self.free, cdiv(num_blocks, per_page))
        self.free -= num_pages
        got = min(num_blocks, num_pages * per_page)
        t.num_empty += num_pages * per_page - got  # the rest of the last page stays empty
        return got

    def take_cached(self, group_id: int, num_blocks: int, out: list[Block]) -> int:
        t = self.groups[group_id]
        got = 0
        while got < num_blocks:
            block = t.oldest_cached()
            if block is None:
                break
            t.evicted.add(block.block_id)
            t.used.add(block.page.index)
            got += 1
        return got

    def oldest_cached(self, group_id: int) -> Block | None:
        return self.groups[group_id].oldest_cached()

    def oldest_unused_page(self, group_id: int) -> LargePage | None:
        return self.groups[group_id].oldest_unused_page()

    def page_value(self, group_id: int, page: LargePage) -> int:
        return self.pool.page_value(group_id, page)  # an unused page is as in the pool

    def reclaim_page(self, group_id: int) -> None:
        if not self.reclaim_pages(group_id, 1):
            raise RuntimeError("no unused page to reclaim")

    def reclaim_pages(self, group_id: int, num_pages: int) -> int:
        count = 0
        while count < num_pages and self._reclaim_one(group_id):
            count += 1
        return count

    def _reclaim_one(self, group_id: int) -> bool:
        t = self.groups[group_id]
        page = t.oldest_unused_page()
        if page is None:
            return False
        t.gone.add(page.index)
        for block in self.pool.blocks_of(page):
            if block.block_hash is not None:
                t.evicted.add(block.block_id)
        t.num_empty -= len(page.empty)
        self.free += 1
        return True
