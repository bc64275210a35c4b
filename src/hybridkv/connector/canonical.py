"""Canonical KV caches: the arena as a connector sees it.

The planner already lays a group's block out as one byte range holding all its layers'
pages back to back (attention K/V, Mamba conv + SSM state, Gated DeltaNet state alike), so
one block of any group moves with one copy. This module names those byte ranges:

    group g:  blocks [num_large_pages, blocks_per_page, block_bytes]  (int8, a view)
              block b = page b // blocks_per_page, slot b % blocks_per_page
              layers: (name, kind, offset, nbytes) inside the block; KV-sharing layers
              point at their target and own no bytes

A group whose blocks fill their large pages exactly (no padding) is also one 2-D view
`(num_blocks, block_bytes)` with a single stride; otherwise the pages' padding lies between
blocks and `gather`/`scatter` address blocks by (page, slot) - still one copy per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridkv.kv.plan import KVCacheConfig, KVCacheGroup


@dataclass(frozen=True)
class LayerRange:
    name: str
    kind: str  # the layer's spec kind: full, sliding_window, chunked_local, mamba, ...
    offset: int  # bytes from the start of the block
    nbytes: int


@dataclass(frozen=True)
class CanonicalGroup:
    group_id: int
    kind: str
    block_bytes: int
    blocks_per_page: int
    # [num_large_pages, blocks_per_page, block_bytes] int8 view of the arena
    blocks: torch.Tensor
    layers: tuple[LayerRange, ...]
    shared_layers: tuple[tuple[str, str], ...]  # (layer, the layer whose bytes it reads)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0] * self.blocks_per_page

    def flat(self) -> torch.Tensor | None:
        """`(num_blocks, block_bytes)` without a copy when the pages hold no padding."""
        pages = self.blocks.shape[0]
        if self.blocks.stride(0) != self.blocks_per_page * self.block_bytes:
            return None
        return self.blocks.as_strided((pages * self.blocks_per_page, self.block_bytes),
                                      (self.block_bytes, 1))

    def _index(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.as_tensor(list(block_ids), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise IndexError(f"group {self.group_id}: block ids must be in "
                             f"[0, {self.num_blocks})")
        ids = ids.to(self.blocks.device)
        return ids // self.blocks_per_page, ids % self.blocks_per_page

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """`[len(block_ids), block_bytes]` copies of these blocks' bytes (one copy)."""
        pages, slots = self._index(block_ids)
        return self.blocks[pages, slots]

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write `[len(block_ids), block_bytes]` bytes into these blocks (one copy)."""
        if data.dtype != torch.int8 or tuple(data.shape) != (len(block_ids), self.block_bytes):
            raise ValueError(f"group {self.group_id}: expected int8 data of shape "
                             f"({len(block_ids)}, {self.block_bytes}), got {data.dtype} "
                             f"{tuple(data.shape)}")
        pages, slots = self._index(block_ids)
        self.blocks[pages, slots] = data.to(self.blocks.device)


@dataclass(frozen=True)
class CanonicalKVCaches:
    groups: tuple[CanonicalGroup, ...]


def group_blocks(arena: torch.Tensor, group: KVCacheGroup) -> torch.Tensor:
    """`[num_large_pages, blocks_per_page, block_bytes]` view of one group's blocks (the
    pages' padding left out). The worker's layer views and the connectors' block copies are
    both cut from this one view."""
    per_page = group.blocks_per_large_page
    blocks: torch.Tensor = arena[:, :per_page * group.block_bytes].unflatten(
        1, (per_page, group.block_bytes))
    return blocks


def canonical_kv_caches(config: KVCacheConfig, arena: torch.Tensor) -> CanonicalKVCaches:
    """Describe `arena` (the `[num_large_pages, large_page_bytes]` int8 tensor the worker
    allocated for `config`) per group; every tensor is a view of it."""
    if arena.dtype != torch.int8 or tuple(arena.shape) != (config.num_large_pages,
                                                            config.large_page_bytes):
        raise ValueError(f"the arena must be int8 of shape ({config.num_large_pages}, "
                         f"{config.large_page_bytes}), got {arena.dtype} "
                         f"{tuple(arena.shape)}")
    groups = []
    for g in config.groups:
        specs = g.layer_specs or (g.spec,) * len(g.layer_names)
        layers, offset = [], 0
        for name, nbytes, spec in zip(g.layer_names, g.layer_page_bytes, specs, strict=True):
            layers.append(LayerRange(name, spec.kind, offset, nbytes))
            offset += nbytes
        groups.append(CanonicalGroup(
            group_id=g.group_id, kind=g.spec.kind, block_bytes=g.block_bytes,
            blocks_per_page=g.blocks_per_large_page, blocks=group_blocks(arena, g),
            layers=tuple(layers),
            shared_layers=g.shared_layers))
    return CanonicalKVCaches(tuple(groups))
