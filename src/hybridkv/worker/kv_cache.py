"""KV tensors: one arena allocated once, each layer a view of its group's blocks.

    arena (int8)  [num_large_pages, large_page_bytes]
    group view    [num_large_pages, blocks_per_page, block_bytes]   (padding left out)
    layer view    [num_large_pages, blocks_per_page, 2, block_size, num_kv_heads, head_size]

Block id b of a group lies at (page b // blocks_per_page, slot b % blocks_per_page). A block
holds its group's layers' pages back to back, so one block is one byte range; the layer views
are strided and need no copy (merging the page and slot dimensions would copy wherever a large
page has padding). Nothing is allocated per step.
"""

from __future__ import annotations

import torch

from hybridkv.kv.plan import KVCacheConfig
from hybridkv.kv.spec import AttentionSpec

TORCH_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
    "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
    "float32": torch.float32, "float": torch.float32,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype {name!r} cannot run here; accepted: "
                         f"{', '.join(sorted(TORCH_DTYPES))}") from None


def allocate_kv_caches(config: KVCacheConfig, device: torch.device | str
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The arena and a view per attention layer (layers of other kinds get none here)."""
    arena = torch.zeros(config.num_large_pages, config.large_page_bytes, dtype=torch.int8,
                        device=device)
    views: dict[str, torch.Tensor] = {}
    for group in config.groups:
        per_page = group.blocks_per_large_page
        blocks = arena[:, :per_page * group.block_bytes].unflatten(
            1, (per_page, group.block_bytes))
        offset = 0
        spec = group.spec
        for name, page_bytes in zip(group.layer_names, group.layer_page_bytes, strict=True):
            if not isinstance(spec, AttentionSpec):
                raise NotImplementedError(
                    f"layer {name}: {spec.kind} KV caches have no tensor layout yet")
            layer = blocks[:, :, offset:offset + page_bytes].view(torch_dtype(spec.dtype))
            views[name] = layer.unflatten(2, (2, spec.block_size, -1, spec.head_size))
            offset += page_bytes
        if group.shared_layer_names:
            raise NotImplementedError(
                f"layers {', '.join(group.shared_layer_names)}: KV sharing is not supported "
                f"by the model runner yet")
    return arena, views
