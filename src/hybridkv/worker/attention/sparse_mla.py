"""Sparse multi-head latent attention (DeepSeek-V3.2's DSA, dots3_note): a lightning indexer
scores every earlier position of a request for each query, and the layer attends to the top
k of them only.

    indexer keys   [pages, per_page, block, Di]   IndexerKeySpec pages, one key per position
    score(t, j)    = sum_h w[t, h] * relu(q[t, h] . key[j] * Di^-0.5)          j <= pos(t)
    selected(t)    = the top k positions of score(t, .)
    out(t)         = softmax attention of q over the latents of selected(t), up-projected

Both reads gather rows over the request's block table (a position's page, slot and offset
in its group's view, `paged_rows`): the indexer reads every key of the context, since it
scores them all; the attention reads only the latents some query of the step selected, and
up-projects each of them once per request. No dense copy of the context's latents is made.
This is the torch reference path: each query's selected keys are materialised ([n, k, H, D]
per request), fine for small models; real sizes want the absorbed form (queries projected
into the latent space) or a kernel that reads the selected rows in place.

Ties. torch.topk on the CPU chooses among equal scores by its selection algorithm over the
whole row, so which of two equal scores wins depends on the row's length and on the masked
entries in it. The reference (transformers) scores a prompt token over a row as long as the
prompt (later positions -inf) and a generated token over its p + 1 positions. Rows are built
the same way here (from AttentionMetadata.prompt_lens), so a query selects the same
positions however its prompt was chunked, cached or recomputed. The ties that occur are
exact zeros: keys for which every head's relu is zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.worker.attention.backend import AttentionMetadata, from_page, to_page
from hybridkv.worker.attention.mla import MLAParams, expand_latents


@dataclass(frozen=True)
class IndexerParams:
    """A lightning indexer's selection: how many positions, and its two scales."""

    top_k: int
    scale: float  # of q . key: index_head_dim ** -0.5
    weight_scale: float  # of the per-head weights: index_n_heads ** -0.5


@dataclass(frozen=True)
class Selection:
    """One request's chosen positions: `positions` [n, k] (query by row), `valid` [n, k]
    where a row has fewer than k earlier positions (padding and masked picks)."""

    positions: torch.Tensor
    valid: torch.Tensor


def paged_rows(meta: AttentionMetadata, row: int, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page, slot, offset) of request `row`'s positions [n] in its group's view."""
    kernel = meta.kernel_block_size
    kernel_ids = meta.block_table[row, positions // kernel]
    # A manager block holds block_size // kernel kernel blocks, in order.
    per_block = meta.block_size // kernel
    blocks = kernel_ids // per_block
    offsets = (kernel_ids % per_block) * kernel + positions % kernel
    return blocks // meta.blocks_per_page, blocks % meta.blocks_per_page, offsets


def write_rows(view: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor) -> None:
    """This step's rows [T, D] (indexer keys, latents) into their slots of `view`."""
    pages, slots, offsets = meta.write_index
    view[pages, slots, offsets] = rows.to(view.dtype)


def select_top_k(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 meta: AttentionMetadata, params: IndexerParams) -> list[Selection]:
    """q [T, Hi, Di] and weights [T, Hi] of this step's tokens; `keys` the indexer's view,
    this step's keys already written. Per request, its queries' selection."""
    out = []
    loc = meta.query_start_loc
    for r, seq_len in enumerate(meta.seq_lens):
        n = loc[r + 1] - loc[r]
        positions = torch.arange(seq_len, device=q.device)
        context = keys[paged_rows(meta, r, positions)].float()  # [L, Di]
        relu = torch.relu(torch.einsum("thd,ld->thl", q[loc[r]:loc[r + 1]].float(), context)
                          * params.scale)
        w = weights[loc[r]:loc[r + 1]].float() * params.weight_scale
        scores = torch.einsum("th,thl->tl", w, relu)  # [n, L]
        prompt = meta.prompt_lens[r] if meta.prompt_lens is not None else seq_len
        out.append(_top_k_rows(scores, seq_len - n, prompt, params.top_k))
    return out


def _top_k_rows(scores: torch.Tensor, first: int, prompt_len: int, top_k: int) -> Selection:
    """The top k of each query's row, rows shaped as the reference shapes them (see the
    module docstring). scores [n, L]: query i is at position first + i."""
    n, seq_len = scores.shape
    q_pos = first + torch.arange(n, device=scores.device)
    # E.g. prompt 40, queries at 38, 39, 40, 41 -> rows of 40, 40, 41, 42.
    row_lens = [max(prompt_len, first + i + 1) for i in range(n)]
    k_max = min(top_k, max(row_lens))
    positions = torch.zeros(n, k_max, dtype=torch.int64, device=scores.device)
    valid = torch.zeros(n, k_max, dtype=torch.bool, device=scores.device)
    for row_len in sorted(set(row_lens)):
        rows = torch.tensor([i for i, m in enumerate(row_lens) if m == row_len],
                            device=scores.device)
        full = scores.new_full((len(rows), row_len), float("-inf"))
        width = min(row_len, seq_len)
        full[:, :width] = scores[rows, :width]
        later = torch.arange(row_len, device=scores.device)[None, :] > q_pos[rows, None]
        full.masked_fill_(later, float("-inf"))
        k = min(top_k, row_len)
        picked = full.topk(k, dim=-1).indices  # [rows, k]
        positions[rows, :k] = picked
        valid[rows, :k] = picked <= q_pos[rows, None]
    return Selection(positions, valid)


def sparse_mla_forward(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, selections: list[Selection],
                       kv_b_weight: torch.Tensor, params: MLAParams) -> torch.Tensor:
    """Write this step's latents [T, rank + rope], then attend q [T, H, nope + rope] (RoPE
    applied) over the latents of each query's selection. Returns [T, H, v_head_dim].
    Quantized pages (kv_cache_dtype) hold latent rows per token: quantized as written,
    dequantized as gathered, as worker/attention/mla.py reads them."""
    pages, slots, offsets = meta.write_index
    kv_cache[pages, slots, offsets] = to_page(latent, kv_cache, meta)
    out = q.new_empty(q.shape[0], params.num_heads, params.v_head_dim)
    loc = meta.query_start_loc
    for r, sel in enumerate(selections):
        # Each latent some query chose, gathered and up-projected once.
        chosen, index = torch.unique(sel.positions[sel.valid], return_inverse=True)
        latents = from_page(kv_cache[paged_rows(meta, r, chosen)], meta, latent.shape[-1],
                            q.dtype).to(q.dtype)  # [u, rank + rope]
        keys, values = expand_latents(latents, kv_b_weight, params)  # [u, H, Dk], [u, H, Dv]
        slot = torch.zeros_like(sel.positions)
        slot[sel.valid] = index
        logits = torch.einsum("nhd,nkhd->nhk", q[loc[r]:loc[r + 1]], keys[slot]) * params.scale
        logits = logits.masked_fill(~sel.valid[:, None, :], float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        out[loc[r]:loc[r + 1]] = torch.einsum("nhk,nkhv->nhv", probs, values[slot])
    return out
