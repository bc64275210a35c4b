"""KV tensors: one arena allocated once, each layer a view of its group's blocks.

    arena (int8)  [num_large_pages, large_page_bytes]
    group view    [num_large_pages, blocks_per_page, block_bytes]   (padding left out)
    layer view    [num_large_pages, blocks_per_page, 2, block_size, num_kv_heads, head_size]
                  (K-only pages: no K/V dimension; MLA: [..., block_size, latent];
                  indexer keys and compressed entries: [..., entries_per_block, head_size])
    quantized     the same, uint8, with each row's bytes (values and their scales, see
                  kv/spec.py) as the last dimension instead of head_size

Block id b of a group lies at (page b // blocks_per_page, slot b % blocks_per_page). A block
holds its group's layers' pages back to back, so one block is one byte range; the layer views
are strided and need no copy (merging the page and slot dimensions would copy wherever a large
page has padding). Nothing is allocated per step.
"""

from __future__ import annotations

import math
import mmap
from typing import Any

import torch

from hybridkv.connector.canonical import group_blocks
from hybridkv.kv.plan import KVCacheConfig
from hybridkv.kv.spec import (
    KEY_GROUP,
    AttentionSpec,
    CompressedAttentionSpec,
    IndexerKeySpec,
    MambaSpec,
)

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


def zeroed_arena(pages: int, page_bytes: int, device: torch.device | str) -> torch.Tensor:
    """int8 [pages, page_bytes] of zeros. On the CPU an anonymous mapping, which the kernel
    hands out zero-filled and backs with memory only where a page is first written: a large
    budget costs resident memory as blocks are used, not at start (torch.zeros writes every
    byte)."""
    if torch.device(device).type != "cpu" or pages * page_bytes == 0:
        return torch.zeros(pages, page_bytes, dtype=torch.int8, device=device)
    region = mmap.mmap(-1, pages * page_bytes)
    # The tensor holds a reference to the mapping: it is unmapped with the last view.
    return torch.frombuffer(region, dtype=torch.int8).view(pages, page_bytes)


def allocate_kv_caches(config: KVCacheConfig, device: torch.device | str
                       ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The arena and a view per layer: a KV tensor for attention layers, a tuple of state
    tensors `[pages, blocks_per_page, *shape]` (e.g. conv and SSM state) for state layers.
    A layer that reuses another layer's KV gets that layer's view."""
    arena = zeroed_arena(config.num_large_pages, config.large_page_bytes, device)
    views: dict[str, Any] = {}
    for group in config.groups:
        blocks = group_blocks(arena, group)
        offset = 0
        layer_specs = group.layer_specs or (group.spec,) * len(group.layer_names)
        for name, page_bytes, spec in zip(group.layer_names, group.layer_page_bytes,
                                          layer_specs, strict=True):
            if isinstance(spec, AttentionSpec):
                raw = blocks[:, :, offset:offset + page_bytes]
                if spec.cache_dtype is None:
                    pages, row = raw.view(torch_dtype(spec.dtype)), spec.head_size
                else:  # quantized rows: bytes
                    pages, row = raw.view(torch.uint8), spec.row_bytes
            if isinstance(spec, AttentionSpec) and spec.latent:
                # One latent per token, no K/V halves: [pages, per_page, block, head_size].
                views[name] = pages.unflatten(2, (spec.block_size, row))
            elif isinstance(spec, (IndexerKeySpec, CompressedAttentionSpec)):
                # One key (one K=V row of all KV heads) per entry: [pages, per_page,
                # entries_per_block, heads x head_size].
                keys = blocks[:, :, offset:offset + page_bytes].view(torch_dtype(spec.dtype))
                views[name] = keys.unflatten(2, (spec.entries_per_block, -1))
            elif isinstance(spec, AttentionSpec) and spec.keys_only:
                # Raw keys only (K and V are derived from them): [pages, per_page, block,
                # Hk, D].
                views[name] = pages.unflatten(2, (spec.block_size, -1, row))
            elif isinstance(spec, AttentionSpec):
                views[name] = pages.unflatten(2, (2, spec.block_size, -1, row))
            elif isinstance(spec, MambaSpec):
                views[name] = _state_views(blocks, offset, spec)
            else:
                raise NotImplementedError(
                    f"layer {name}: {spec.kind} KV caches have no tensor layout yet")
            offset += page_bytes
        for layer, target in group.shared_layers:
            views[layer] = views[target]  # KV sharing: the same tensor, no pages of its own
    return arena, views


def _state_views(blocks: torch.Tensor, offset: int, spec: MambaSpec
                 ) -> tuple[torch.Tensor, ...]:
    """One layer's states inside its block: each shape's bytes back to back."""
    views = []
    for shape, dtype_name in zip(spec.shapes, spec.dtypes, strict=True):
        dtype = torch_dtype(dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        views.append(blocks[:, :, offset:offset + nbytes].view(dtype).unflatten(2, shape))
        offset += nbytes
    return tuple(views)


def allocate_key_staging(config: KVCacheConfig, views: dict[str, Any], max_num_seqs: int,
                         device: torch.device | str) -> dict[int, dict[int, torch.Tensor]]:
    """Per group with q4 K/V pages (kv/spec.py `q4_kv`), per layer (by its view's data_ptr,
    which KV-sharing layers share): the full-precision keys of each running request's
    unfinished key group, [max_num_seqs, KEY_GROUP, Hk, D] in the model's dtype. About
    KEY_GROUP tokens of float keys per request and layer, beside the pages."""
    staging: dict[int, dict[int, torch.Tensor]] = {}
    for group in config.groups:
        layer_specs = group.layer_specs or (group.spec,) * len(group.layer_names)
        for name, spec in zip(group.layer_names, layer_specs, strict=True):
            if isinstance(spec, AttentionSpec) and spec.q4_kv:
                staging.setdefault(group.group_id, {})[views[name].data_ptr()] = torch.zeros(
                    max_num_seqs, KEY_GROUP, spec.num_kv_heads, spec.head_size,
                    dtype=torch_dtype(spec.dtype), device=device)
    return staging
