"""The KV tensors over the arena: every layer view lands on exactly the bytes the planner gave
its group's block (page b // blocks_per_page, slot b % blocks_per_page, the layer's offset
inside the block), state tensors included, and KV-sharing layers alias their target. The
canonical KV caches of connectors rest on this layout."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.kv.plan import plan_kv_cache  # noqa: E402
from hybridkv.kv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec  # noqa: E402
from hybridkv.worker.kv_cache import allocate_kv_caches  # noqa: E402


def _config():
    specs = {
        "full.0": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="fp32"),
        "full.1": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="fp32"),
        "swa.0": SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="fp16",
                                   sliding_window=8),
        "ssm.0": MambaSpec(block_size=4, shapes=((3, 5), (2, 4, 4)), dtypes=("fp32", "fp16")),
        "full.2": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="fp32"),
    }
    plan = plan_kv_cache(specs, 1 << 20, max_model_len=64, max_num_batched_tokens=16,
                         kv_sharing={"full.2": "full.0"})
    return plan.config


def _byte_range(config, group, layer: str, block: int) -> tuple[int, int]:
    """(start, end) in the flat arena of one layer's page in one block, from the plan."""
    i = group.layer_names.index(layer)
    page, slot = divmod(block, group.blocks_per_large_page)
    start = (page * config.large_page_bytes + slot * group.block_bytes
             + sum(group.layer_page_bytes[:i]))
    return start, start + group.layer_page_bytes[i]


def _written_bytes(arena: torch.Tensor) -> set[int]:
    return set(torch.nonzero(arena.flatten()).flatten().tolist())


@pytest.mark.parametrize("block", [1, 2, 7])
def test_every_layer_view_writes_exactly_its_planned_bytes(block):
    config = _config()
    for group in config.groups:
        if block >= group.blocks_per_large_page * config.num_large_pages:
            continue
        for layer in group.layer_names:
            arena, views = allocate_kv_caches(config, "cpu")
            view = views[layer]
            if isinstance(view, tuple):  # state: every state tensor of the block
                page, slot = divmod(block, group.blocks_per_large_page)
                for tensor in view:
                    tensor[page, slot].fill_(1)
            else:  # attention: [pages, blocks_per_page, 2, block_size, heads, head_size]
                assert view.shape[2:] == (2, group.block_size, *view.shape[4:])
                page, slot = divmod(block, group.blocks_per_large_page)
                view[page, slot].fill_(1)
            start, end = _byte_range(config, group, layer, block)
            written = _written_bytes(arena)
            assert written and min(written) >= start and max(written) < end, layer


def test_state_views_hold_each_shape_back_to_back():
    config = _config()
    (group,) = [g for g in config.groups if g.spec.is_state]
    _, views = allocate_kv_caches(config, "cpu")
    conv, ssm = views["ssm.0"]
    assert conv.shape[2:] == (3, 5) and conv.dtype == torch.float32
    assert ssm.shape[2:] == (2, 4, 4) and ssm.dtype == torch.float16
    assert group.block_bytes == 3 * 5 * 4 + 2 * 4 * 4 * 2
    # One block's two tensors are adjacent: the SSM state starts where the conv state ends.
    assert ssm[1, 0].data_ptr() - conv[1, 0].data_ptr() == 3 * 5 * 4


def test_a_sharing_layer_aliases_its_target_and_owns_no_bytes():
    config = _config()
    _, views = allocate_kv_caches(config, "cpu")
    assert views["full.2"] is views["full.0"]
    owned = {name for g in config.groups for name in g.layer_names}
    assert "full.2" not in owned
    full = next(g for g in config.groups if "full.0" in g.layer_names)
    assert full.layer_names == ("full.0", "full.1")
    assert full.block_bytes == 2 * (2 * 4 * 2 * 8 * 4)


def test_groups_never_overlap_inside_a_large_page():
    """Blocks of different groups live on different large pages; inside one page a group's
    blocks fill slots [0, blocks_per_page) and the rest is padding."""
    config = _config()
    for group in config.groups:
        used = group.blocks_per_large_page * group.block_bytes
        assert used + group.padding_bytes_per_large_page(config.large_page_bytes) == \
            config.large_page_bytes
        assert group.blocks_per_large_page >= 1
