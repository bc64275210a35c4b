"""Attention over the paged KV cache: per-group metadata and a small backend registry.

The torch reference backend runs anywhere torch runs (CPU is the tested path): it writes K/V
through the slot mapping, then attends request by request over the request's blocks with
causal, sliding-window and chunked masks, GQA, logit soft-capping and attention sinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """One group's view of the batch; every group lists requests in the same order."""

    query_start_loc: list[int]  # [num_reqs + 1] offsets of each request's tokens
    seq_lens: list[int]  # per request: context length once this step's tokens are in
    block_table: torch.Tensor  # [num_reqs, max_kernel_blocks] kernel block ids
    slot_mapping: torch.Tensor  # [num_tokens] kernel_block_id * kernel_block_size + offset
    block_size: int  # the manager's block size (tokens per block of the KV view)
    kernel_block_size: int
    blocks_per_page: int  # of the group's KV views: block b is (page b // n, slot b % n)
    # Masks of the decode batch per (window, chunk), shared by the group's layers.
    _masks: dict[tuple[int | None, int | None], torch.Tensor] = field(default_factory=dict)

    # Everything below depends only on the batch, not on the layer: computed once per step
    # by the first layer that asks, reused by the others.
    @cached_property
    def write_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page, slot, offset) where each scheduled token's K/V goes."""
        blocks = self.slot_mapping // self.block_size
        offsets = self.slot_mapping % self.block_size
        return blocks // self.blocks_per_page, blocks % self.blocks_per_page, offsets

    @cached_property
    def decode_rows(self) -> list[int]:
        """Requests with exactly one query token (batched together)."""
        loc = self.query_start_loc
        return [r for r in range(len(self.seq_lens)) if loc[r + 1] - loc[r] == 1]

    @cached_property
    def decode_batch(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """(token index [R], sequence lengths [R], gather index into the KV view)."""
        rows = self.decode_rows
        device = self.slot_mapping.device
        tokens = torch.tensor([self.query_start_loc[r] for r in rows], device=device)
        seq_lens = torch.tensor([self.seq_lens[r] for r in rows], device=device)
        kb = self.kernel_block_size
        kernel_ids = self.block_table[torch.tensor(rows, device=device),
                                      :-(-int(seq_lens.max()) // kb)]  # [R, n]
        k_per_block = self.block_size // kb
        if k_per_block == 1:
            return tokens, seq_lens, (kernel_ids,)  # block ids, for index_select
        blocks = kernel_ids // k_per_block
        pages, slots = blocks // self.blocks_per_page, blocks % self.blocks_per_page
        return tokens, seq_lens, (pages, slots, kernel_ids % k_per_block)

    def decode_mask(self, window: int | None, chunk: int | None) -> torch.Tensor:
        """[R, L]: which cached positions each decode query may attend to."""
        mask = self._masks.get((window, chunk))
        if mask is None:
            _, seq_lens, index = self.decode_batch
            num_pos = index[-1].shape[1] * self.kernel_block_size
            k_pos = torch.arange(num_pos, device=seq_lens.device).unsqueeze(0)  # [1, L]
            q_pos = (seq_lens - 1).unsqueeze(1)  # [R, 1]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= q_pos - k_pos < window
            if chunk is not None:
                mask &= k_pos // chunk == q_pos // chunk
            self._masks[(window, chunk)] = mask
        return mask


@dataclass(frozen=True)
class AttentionParams:
    """What a layer asks of the backend besides its tensors."""

    scale: float
    sliding_window: int | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_heads] learned sink logits


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                params: AttentionParams) -> torch.Tensor:
        """Write k/v (None for a layer that reads another layer's cache), then attend."""


class TorchReferenceBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                params: AttentionParams) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] or None (KV sharing: the cache is already written);
        kv_cache [pages, blocks_per_page, 2, block, Hk, D]. Returns [T, Hq, D]."""
        if k is not None and v is not None:
            self._write(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        for r in range(len(meta.seq_lens)):
            start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            if end - start > 1:  # prompt chunks one by one; single tokens batched below
                keys, values = self._gather(kv_cache, meta, r)
                out[start:end] = _attend(q[start:end], keys, values, meta.seq_lens[r], params)
        if meta.decode_rows:
            tokens = meta.decode_batch[0]
            out[tokens] = self._decode_batch(q[tokens], kv_cache, meta, params)
        return out

    @staticmethod
    def _decode_batch(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      params: AttentionParams) -> torch.Tensor:
        """One query per request, all requests at once. q [R, Hq, D] -> [R, Hq, D]."""
        _, _, index = meta.decode_batch
        # K and V gathered apart, each straight into a contiguous [R, n, block, H, D].
        flat = _flat_blocks(kv_cache)
        if len(index) == 1 and flat is not None:
            ids = index[0].flatten()
            shape = (*index[0].shape, *flat.shape[2:])
            keys = flat[:, 0].index_select(0, ids).view(shape)
            values = flat[:, 1].index_select(0, ids).view(shape)
        elif len(index) == 1:  # padded large pages: no flat block view
            blocks = index[0]
            pages, slots = blocks // meta.blocks_per_page, blocks % meta.blocks_per_page
            keys, values = kv_cache[pages, slots, 0], kv_cache[pages, slots, 1]
        else:  # kernel blocks inside manager blocks
            split = kv_cache.unflatten(3, (meta.block_size // meta.kernel_block_size,
                                           meta.kernel_block_size))
            keys = split[index[0], index[1], 0, index[2]]
            values = split[index[0], index[1], 1, index[2]]
        keys, values = keys.flatten(1, 2), values.flatten(1, 2)  # [R, L, Hk, D]
        num_reqs, num_heads, head_dim = q.shape
        num_kv_heads = keys.shape[2]
        group = num_heads // num_kv_heads
        allowed = meta.decode_mask(params.sliding_window, params.chunk_size)
        if params.softcap is None and params.sinks is None:
            # Plain softmax attention: torch's fused kernel (on CPU and CUDA alike).
            out = nn.functional.scaled_dot_product_attention(
                q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=allowed[:, None, None, :], scale=params.scale,
                enable_gqa=group > 1)  # [R, Hq, 1, D]
            return out.squeeze(2)
        # Query heads grouped by the KV head they share: [R, Hk, G, D]
        qg = q.float().view(num_reqs, num_kv_heads, group, head_dim)
        scores = torch.einsum("rkgd,rlkd->rkgl", qg, keys.float()) * params.scale
        if params.softcap is not None:
            scores = torch.tanh(scores / params.softcap) * params.softcap
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        if params.sinks is not None:
            sink = params.sinks.float().view(1, num_kv_heads, group, 1).expand(
                num_reqs, -1, -1, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("rkgl,rlkd->rkgd", probs, values.float())
        return out.reshape(num_reqs, num_heads, head_dim).to(q.dtype)

    @staticmethod
    def _write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> None:
        # Kernel slots and manager slots are the same numbers (see BlockTable).
        pages, slots, offsets = meta.write_index
        kv_cache[pages, slots, 0, offsets] = k.to(kv_cache.dtype)
        kv_cache[pages, slots, 1, offsets] = v.to(kv_cache.dtype)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, meta: AttentionMetadata, r: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        kb = meta.kernel_block_size
        k_per_block = meta.block_size // kb
        seq_len = meta.seq_lens[r]
        kernel_ids = meta.block_table[r, :-(-seq_len // kb)]
        flat = _flat_blocks(kv_cache)
        if k_per_block == 1 and flat is not None:
            keys = flat[:, 0].index_select(0, kernel_ids).flatten(0, 1)[:seq_len]
            values = flat[:, 1].index_select(0, kernel_ids).flatten(0, 1)[:seq_len]
            return keys, values
        blocks, sub = kernel_ids // k_per_block, kernel_ids % k_per_block
        per_page = kv_cache.shape[1]
        # [pages, per_page, 2, k, kb, H, D]: kernel block `sub` of manager block `blocks`
        split = kv_cache.unflatten(3, (k_per_block, kb))
        gathered = split[blocks // per_page, blocks % per_page, :, sub]  # [n, 2, kb, H, D]
        keys = gathered[:, 0].flatten(0, 1)[:seq_len]
        values = gathered[:, 1].flatten(0, 1)[:seq_len]
        return keys, values


def _flat_blocks(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """[num_blocks, 2, block, H, D] view of [pages, per_page, ...] when the large pages have
    no padding for this group (then blocks are evenly spaced), else None."""
    if kv_cache.shape[1] == 1:  # one block per page (a size-1 dim's stride is arbitrary)
        return kv_cache[:, 0]
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        return None
    return kv_cache.flatten(0, 1)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int,
            params: AttentionParams) -> torch.Tensor:
    """q [nq, Hq, D] are the last nq positions of a sequence of seq_len; keys/values
    [seq_len, Hk, D]. With a window or chunk, queries go in blocks of that size, each over
    only the keys it can see: a long prompt costs O(nq * window), not O(nq * seq_len)."""
    num_q = q.shape[0]
    first = seq_len - num_q
    local = params.sliding_window or params.chunk_size
    if local is None or num_q <= local:
        return _attend_block(q, keys, values, first, 0, params)
    out = torch.empty_like(q)
    start = first
    while start < seq_len:
        end = min(start + local, seq_len)
        k_start = 0
        if params.sliding_window is not None:
            k_start = max(k_start, start - params.sliding_window + 1)
        if params.chunk_size is not None:
            end = min(end, (start // params.chunk_size + 1) * params.chunk_size)
            k_start = max(k_start, start // params.chunk_size * params.chunk_size)
        out[start - first:end - first] = _attend_block(
            q[start - first:end - first], keys[k_start:end], values[k_start:end], start,
            k_start, params)
        start = end
    return out


def _attend_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int,
                  k_start: int, params: AttentionParams) -> torch.Tensor:
    """Queries at positions q_start.. over keys at positions k_start.. (the keys end where
    the queries end)."""
    num_q, num_heads = q.shape[0], q.shape[1]
    group = num_heads // keys.shape[1]
    q_pos = torch.arange(q_start, q_start + num_q, device=q.device).unsqueeze(1)
    k_pos = torch.arange(k_start, k_start + keys.shape[0], device=q.device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if params.sliding_window is not None:
        allowed &= q_pos - k_pos < params.sliding_window
    if params.chunk_size is not None:
        allowed &= k_pos // params.chunk_size == q_pos // params.chunk_size
    if params.softcap is None and params.sinks is None:
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=allowed, scale=params.scale, enable_gqa=group > 1)  # [Hq, nq, D]
        return out.transpose(0, 1)
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if params.sinks is not None:
        # A per-head sink logit joins the softmax and takes probability mass, no value.
        sink = params.sinks.float().view(num_heads, 1, 1).expand(num_heads, num_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, values.float())
    return out.to(q.dtype)


BACKENDS: dict[str, type[TorchReferenceBackend]] = {"torch": TorchReferenceBackend}


def get_backend(name: str) -> AttentionBackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: "
                         f"{', '.join(BACKENDS)}") from None
