"""The block pool's integrity check: every count and index recomputed from the blocks.

Tests call it after each scenario and after every step of the oracle state machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.kv.block_pool import BlockPool, LargePage


def check_pool(pool: BlockPool) -> None:
    """Recount everything from the blocks themselves; raise AssertionError on a mismatch."""
    free = set(pool.free_pages)
    assert len(free) == len(pool.free_pages), "a page is twice in the free list"
    assert 0 not in free, "the null page is in the free list"
    for block in pool.null_blocks:
        assert block.ref_cnt >= 1 and block.block_hash is None, "null block changed"
    owned: list[list[LargePage]] = [[] for _ in pool.groups]
    for index, page in enumerate(pool.pages[1:], start=1):
        if index in free:
            assert page is None or (page.group_id is None and not page.empty and all(
                b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks_of(page))), \
                f"free page {index} owned or holds a live block"
            continue
        assert page is not None and page.group_id is not None, \
            f"page {index} neither free nor owned"
        _check_page(pool, page)
        owned[page.group_id].append(page)
        assert pool.single_blocks[index] is None or pool.page_blocks[index] is None, \
            f"page {index} laid out twice"
    for gs in pool.groups:
        pages = owned[gs.group_id]
        assert gs.num_pages == len(pages), f"group {gs.group_id} page count"
        assert gs.num_empty == sum(len(p.empty) for p in pages), "empty count"
        assert set(gs.open_pages) == {p.index for p in pages if p.empty}, "open pages"
        unused = {p.index for p in pages if p.num_used == 0}
        if gs.track_unused:
            assert set(gs.unused_pages) == unused, "unused pages"
        else:
            assert not gs.unused_pages, "untracked unused pages"
            assert unused == {b.page.index for b in gs.lru.values()}, "unused pages"
        blocks = [b for p in pages for b in pool.blocks_of(p)]
        assert gs.num_used == sum(b.ref_cnt > 0 for b in blocks), "used count"
        lru = {b.block_id for b in blocks if b.ref_cnt == 0 and b.block_hash is not None}
        assert set(gs.lru) == lru, f"group {gs.group_id} LRU holds the wrong blocks"
        hashed = {b.block_hash: b for b in blocks if b.block_hash is not None}
        assert len(hashed) == sum(b.block_hash is not None for b in blocks), "dup hash"
        assert gs.cached == hashed, f"group {gs.group_id} hash index mismatch"


def _check_page(pool: BlockPool, page: LargePage) -> None:
    assert page.group_id is not None
    per_page = pool.groups[page.group_id].blocks_per_page
    blocks = pool.blocks_of(page)
    assert len(blocks) == per_page and all(
        b.page is page and b.group_id == page.group_id
        and b.block_id == page.index * per_page + slot for slot, b in enumerate(blocks)), \
        f"page {page.index} holds blocks of another layout"
    assert all(b.ref_cnt >= 0 for b in blocks), "negative ref count"
    assert page.num_used == sum(b.ref_cnt > 0 for b in blocks), f"page {page.index} used"
    assert page.num_hashed == sum(b.block_hash is not None for b in blocks), "hashed"
    empty = [b for b in blocks if b.ref_cnt == 0 and b.block_hash is None]
    assert sorted(b.block_id for b in page.empty) == sorted(b.block_id for b in empty), \
        f"page {page.index} empty list"
    assert page.num_used or page.num_hashed, f"page {page.index} all empty but owned"
