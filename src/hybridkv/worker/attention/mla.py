"""Multi-head latent attention (MLA) over the paged KV cache: one latent vector per token
instead of per-head keys and values.

A layer's page holds, per token, the normalised compressed KV c_kv (`kv_lora_rank` wide)
followed by the key part that carries RoPE, k_pe (shared by every head):

    kv_cache [pages, blocks_per_page, block_size, kv_lora_rank + rope_dim]

At attention time each request's latents are gathered from its blocks and up-projected with
the layer's kv_b_proj into per-head k_nope and v; keys are [k_nope | k_pe], and attention is
plain causal softmax attention over the request's context (the exact form the reference
computes; the "absorbed" form, queries projected into the latent space, is a speed-up left
for later). Requests are batched as the metadata's plan says, like every attention group, so
prefix hits, chunked prefill, preemption and kernel blocks inside manager blocks behave the
same: only the page layout differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.worker.attention.backend import AttentionMetadata, from_page, to_page


@dataclass(frozen=True)
class MLAParams:
    """The sizes that turn a latent into keys and values, and the softmax scale."""

    scale: float
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    # A query attends to itself and the `sliding_window - 1` positions before it; None: all.
    sliding_window: int | None = None


def mla_forward(q: torch.Tensor, latent: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, kv_b_weight: torch.Tensor, params: MLAParams
                ) -> torch.Tensor:
    """q [T, H, nope + rope] (RoPE applied), latent [T, rank + rope] (k_pe roped) or None
    when already written; kv_b_weight [H * (nope + v), rank]. Writes the latents, then
    returns the attention output [T, H, v_head_dim]."""
    if latent is not None:
        pages, slots, offsets = meta.write_index
        kv_cache[pages, slots, offsets] = to_page(latent, kv_cache, meta)
    # Planned without the window, so no request goes alone: every context is read from
    # position 0 and the window is a mask (blocks a sliding group dropped read as its null
    # block, masked). O(context) per query where O(window) would do: fine while MLA windows
    # are the small ones of dots3_note.
    batches, _ = meta.plan(None, None)
    out = q.new_empty(q.shape[0], params.num_heads, params.v_head_dim)
    for batch in batches:
        latents = gather_latents(kv_cache, meta, batch.gather)  # [P, L, rank + rope]
        # Quantized pages: rows of the latent's width (rank + rope).
        latents = from_page(latents, meta,
                            params.kv_lora_rank + q.shape[-1] - params.qk_nope_head_dim, q.dtype)
        keys, values = expand_latents(latents.to(q.dtype), kv_b_weight, params)
        allowed = batch.mask(params.sliding_window, None, meta.kernel_block_size)  # [P, Qm, L]
        res = nn.functional.scaled_dot_product_attention(
            q[batch.tokens].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=allowed[:, None], scale=params.scale).transpose(1, 2)  # [P, Qm, H, v]
        if batch.all_valid:
            out[batch.tokens.flatten()] = res.flatten(0, 1)
        else:
            out[batch.tokens[batch.valid]] = res[batch.valid]
    return out


def expand_latents(latents: torch.Tensor, kv_b_weight: torch.Tensor, params: MLAParams
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """latents [..., rank + rope] -> keys [..., H, nope + rope], values [..., H, v]."""
    c_kv, k_pe = latents.split([params.kv_lora_rank, latents.shape[-1] - params.kv_lora_rank],
                               dim=-1)
    kv = nn.functional.linear(c_kv, kv_b_weight).unflatten(-1, (params.num_heads, -1))
    k_nope, values = kv.split([params.qk_nope_head_dim, params.v_head_dim], dim=-1)
    k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], k_pe.shape[-1])
    return torch.cat([k_nope, k_pe], dim=-1), values


def gather_latents(kv_cache: torch.Tensor, meta: AttentionMetadata,
                   index: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The latents of the blocks in `index` ([P, n] manager block ids, or (page, slot,
    kernel block) when kernel blocks split manager blocks): [P, n * kernel_block, D]."""
    if len(index) == 1:
        blocks = index[0]
        latents = kv_cache[blocks // meta.blocks_per_page, blocks % meta.blocks_per_page]
    else:
        split = kv_cache.unflatten(2, (meta.block_size // meta.kernel_block_size,
                                       meta.kernel_block_size))
        latents = split[index[0], index[1], index[2]]
    return latents.flatten(1, 2)  # [P, n, block, D] -> [P, L, D]
