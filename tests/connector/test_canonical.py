"""Canonical KV caches: each group's blocks as int8 byte ranges of the arena, with each
layer's place inside a block. A block of any group (attention or state) copied through them
to another arena reproduces every layer's view there, and touches no other block."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.connector.canonical import canonical_kv_caches  # noqa: E402
from hybridkv.kv.plan import plan_kv_cache  # noqa: E402
from hybridkv.kv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec  # noqa: E402
from hybridkv.worker.kv_cache import allocate_kv_caches  # noqa: E402

SPECS = {
    "full.0": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="fp32"),
    "full.1": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="fp16"),
    "swa.0": SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="fp32",
                               sliding_window=8),
    "ssm.0": MambaSpec(block_size=4, shapes=((3, 5), (2, 4, 4)), dtypes=("fp32", "fp32")),
    "full.2": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="fp32"),
}


def _config():
    plan = plan_kv_cache(SPECS, 1 << 20, max_model_len=64, max_num_batched_tokens=16,
                         kv_sharing={"full.2": "full.0"}, hybrid=True)
    return plan.config


def _same_bytes(a, b) -> bool:
    # Random bytes read as floats hold NaNs, which never compare equal: compare bytes.
    return torch.equal(a.contiguous().view(torch.int8), b.contiguous().view(torch.int8))


def test_every_group_and_layer_is_described():
    config = _config()
    arena, _ = allocate_kv_caches(config, "cpu")
    caches = canonical_kv_caches(config, arena)
    kinds = {g.kind for g in caches.groups}
    assert {"full", "sliding_window", "mamba"} <= kinds
    for group, planned in zip(caches.groups, config.groups, strict=True):
        assert group.block_bytes == planned.block_bytes
        assert [r.name for r in group.layers] == list(planned.layer_names)
        assert sum(r.nbytes for r in group.layers) == group.block_bytes
        assert group.blocks.data_ptr() == arena[0].data_ptr()  # a view, no copy
    full = next(g for g in caches.groups if any(r.name == "full.0" for r in g.layers))
    assert full.shared_layers == (("full.2", "full.0"),)


def test_a_block_moves_with_one_copy_for_every_kind_of_group():
    config = _config()
    src_arena, src_views = allocate_kv_caches(config, "cpu")
    dst_arena, dst_views = allocate_kv_caches(config, "cpu")
    src = canonical_kv_caches(config, src_arena)
    dst = canonical_kv_caches(config, dst_arena)
    torch.manual_seed(0)
    src_arena.copy_(torch.randint(-128, 127, src_arena.shape, dtype=torch.int8))
    for g_src, g_dst, planned in zip(src.groups, dst.groups, config.groups, strict=True):
        block, target = 3, 5  # block 3 of the source lands in block 5 of the destination
        before = dst_arena.clone()
        g_dst.scatter([target], g_src.gather([block]))
        page, slot = divmod(block, planned.blocks_per_large_page)
        tpage, tslot = divmod(target, planned.blocks_per_large_page)
        for name in planned.layer_names:
            view_src, view_dst = src_views[name], dst_views[name]
            if isinstance(view_src, tuple):  # state: conv and SSM tensors
                for a, b in zip(view_src, view_dst, strict=True):
                    assert _same_bytes(a[page, slot], b[tpage, tslot])
            else:
                assert _same_bytes(view_src[page, slot], view_dst[tpage, tslot])
        changed = (dst_arena != before).nonzero()
        assert changed.numel() and set(changed[:, 0].tolist()) == {tpage}


def test_flat_view_only_without_padding_and_bad_writes_refused():
    config = _config()
    arena, _ = allocate_kv_caches(config, "cpu")
    for group, planned in zip(canonical_kv_caches(config, arena).groups, config.groups,
                              strict=True):
        flat = group.flat()
        if planned.padding_bytes_per_large_page(config.large_page_bytes):
            assert flat is None
        else:
            assert flat is not None and flat.shape == (group.num_blocks, group.block_bytes)
            assert torch.equal(flat[7], group.gather([7])[0])
        with pytest.raises(IndexError):
            group.gather([group.num_blocks])
        with pytest.raises(ValueError, match="expected int8"):
            group.scatter([1], torch.zeros(1, group.block_bytes, dtype=torch.float32))
