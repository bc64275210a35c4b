"""Attention over the paged KV cache: per-group metadata and a small backend registry.

The torch reference backend runs anywhere torch runs (CPU is the tested path): it writes K/V
through the slot mapping, then attends request by request over the request's blocks with
causal, sliding-window and chunked masks, GQA, logit soft-capping and attention sinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """One group's view of the batch; every group lists requests in the same order."""

    query_start_loc: list[int]  # [num_reqs + 1] offsets of each request's tokens
    seq_lens: list[int]  # per request: context length once this step's tokens are in
    block_table: torch.Tensor  # [num_reqs, max_kernel_blocks] kernel block ids
    slot_mapping: torch.Tensor  # [num_tokens] kernel_block_id * kernel_block_size + offset
    block_size: int  # the manager's block size (tokens per block of the KV view)
    kernel_block_size: int


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                params: AttentionParams) -> torch.Tensor: ...


class TorchReferenceBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                params: AttentionParams) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D]; kv_cache [pages, blocks_per_page, 2, block, Hk, D].
        Returns [T, Hq, D]."""
        self._write(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        decodes = []
        for r in range(len(meta.seq_lens)):
            start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            if end - start == 1:
                decodes.append(r)  # batched below
            elif end > start:
                keys, values = self._gather(kv_cache, meta, r)
                out[start:end] = _attend(q[start:end], keys, values, meta.seq_lens[r], params)
        if decodes:
            rows = torch.tensor(decodes, dtype=torch.int64, device=q.device)
            tokens = torch.tensor([meta.query_start_loc[r] for r in decodes],
                                  dtype=torch.int64, device=q.device)
            seq_lens = torch.tensor([meta.seq_lens[r] for r in decodes], dtype=torch.int64,
                                    device=q.device)
            out[tokens] = self._decode_batch(q[tokens], kv_cache, meta, rows, seq_lens, params)
        return out

    @staticmethod
    def _decode_batch(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      rows: torch.Tensor, seq_lens: torch.Tensor,
                      params: AttentionParams) -> torch.Tensor:
        """One query per request, all requests at once. q [R, Hq, D] -> [R, Hq, D]."""
        kb = meta.kernel_block_size
        k_per_block = meta.block_size // kb
        num_kernel_blocks = -(-int(seq_lens.max()) // kb)
        kernel_ids = meta.block_table[rows, :num_kernel_blocks]  # [R, n]
        blocks, sub = kernel_ids // k_per_block, kernel_ids % k_per_block
        per_page = kv_cache.shape[1]
        split = kv_cache.unflatten(3, (k_per_block, kb))
        gathered = split[blocks // per_page, blocks % per_page, :, sub]  # [R, n, 2, kb, H, D]
        keys = gathered[:, :, 0].flatten(1, 2)  # [R, L, Hk, D]
        values = gathered[:, :, 1].flatten(1, 2)
        num_reqs, num_heads, head_dim = q.shape
        num_kv_heads = keys.shape[2]
        group = num_heads // num_kv_heads
        # Query heads grouped by the KV head they share: [R, Hk, G, D]
        qg = q.float().view(num_reqs, num_kv_heads, group, head_dim)
        scores = torch.einsum("rkgd,rlkd->rkgl", qg, keys.float()) * params.scale
        if params.softcap is not None:
            scores = torch.tanh(scores / params.softcap) * params.softcap
        k_pos = torch.arange(keys.shape[1], device=q.device).unsqueeze(0)  # [1, L]
        q_pos = (seq_lens - 1).unsqueeze(1)  # [R, 1]
        allowed = k_pos <= q_pos
        if params.sliding_window is not None:
            allowed &= q_pos - k_pos < params.sliding_window
        if params.chunk_size is not None:
            allowed &= k_pos // params.chunk_size == q_pos // params.chunk_size
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
        blocks = meta.slot_mapping // meta.block_size
        offsets = meta.slot_mapping % meta.block_size
        per_page = kv_cache.shape[1]
        pages, slots = blocks // per_page, blocks % per_page
        kv_cache[pages, slots, 0, offsets] = k.to(kv_cache.dtype)
        kv_cache[pages, slots, 1, offsets] = v.to(kv_cache.dtype)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, meta: AttentionMetadata, r: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        kb = meta.kernel_block_size
        k_per_block = meta.block_size // kb
        seq_len = meta.seq_lens[r]
        kernel_ids = meta.block_table[r, :-(-seq_len // kb)]
        blocks, sub = kernel_ids // k_per_block, kernel_ids % k_per_block
        per_page = kv_cache.shape[1]
        # [pages, per_page, 2, k, kb, H, D]: kernel block `sub` of manager block `blocks`
        split = kv_cache.unflatten(3, (k_per_block, kb))
        gathered = split[blocks // per_page, blocks % per_page, :, sub]  # [n, 2, kb, H, D]
        keys = gathered[:, 0].flatten(0, 1)[:seq_len]
        values = gathered[:, 1].flatten(0, 1)[:seq_len]
        return keys, values


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int,
            params: AttentionParams) -> torch.Tensor:
    """q [nq, Hq, D] are the last nq positions of a sequence of seq_len; keys/values
    [seq_len, Hk, D]."""
    num_q, num_heads = q.shape[0], q.shape[1]
    group = num_heads // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if params.sliding_window is not None:
        allowed &= q_pos - k_pos < params.sliding_window
    if params.chunk_size is not None:
        allowed &= k_pos // params.chunk_size == q_pos // params.chunk_size
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
