"""Query-sparse attention (Qwen4-Exp's QSA) over K/V pages: an indexer scores each query
against compressed keys, one per `compress_ratio` positions, and the layer attends to the
positions of the top blocks and to the query's unfinished block.

    raw keys      [pages, per_page, block, Di]    IndexerKeySpec pages, one key per position
    block key b   = pool(raw keys of positions [b r, (b + 1) r))     (the model's pooling:
                    mean, norm, RoPE at b r)
    score(t, b)   = sum_h relu(q[t, h] . key_b) / sqrt(Di)        b < nb(t) = (pos(t) + 1) // r
    selected(t)   = positions of the top k of score(t, .) + positions [nb(t) r, pos(t)]

Each query's row holds exactly its nb(t) complete blocks, as in the reference, so torch.topk
sees the same row (and breaks ties the same way) however the prompt was chunked. Reads
gather over the block tables (worker/attention/sparse_mla.py `paged_rows`): the indexer
every raw key of the context, the attention only the K/V rows some query of the step
selected (each query's rows materialised, [n, S, Hk, D]: the torch reference path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridkv.worker.attention.backend import AttentionMetadata, from_page
from hybridkv.worker.attention.sparse_mla import Selection, paged_rows

# (raw keys of complete blocks [NB, r, Di], their first positions [NB]) -> block keys
# [NB, Di]: the model's compression.
Pool = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class QSAParams:
    block_top_k: int  # blocks kept per query: the token budget // compress_ratio
    compress_ratio: int


def select_blocks(q: torch.Tensor, keys: torch.Tensor, meta: AttentionMetadata,
                  params: QSAParams, pool: Pool) -> list[Selection]:
    """q [T, Hi, Di] (normed, RoPE applied); `keys` the indexer's raw-key view with this
    step's keys written. Per request, its queries' selected positions."""
    ratio, out = params.compress_ratio, []
    # The most positions a query reads: its blocks and up to ratio - 1 of the unfinished
    # one (slots for ratio, the last never valid, keep the slicing below simple).
    width = (params.block_top_k + 1) * ratio
    loc = meta.query_start_loc
    for r, seq_len in enumerate(meta.seq_lens):
        n, first = loc[r + 1] - loc[r], seq_len - (loc[r + 1] - loc[r])
        positions = torch.zeros(n, width, dtype=torch.int64, device=q.device)
        valid = torch.zeros(n, width, dtype=torch.bool, device=q.device)
        num_blocks = seq_len // ratio
        if num_blocks:
            raw = keys[paged_rows(meta, r, torch.arange(num_blocks * ratio, device=q.device))]
            starts = torch.arange(num_blocks, device=q.device) * ratio
            block_keys = pool(raw.unflatten(0, (num_blocks, ratio)), starts)  # [NB, Di]
            scores = torch.relu(torch.einsum("thd,bd->tbh", q[loc[r]:loc[r + 1]].float(),
                                             block_keys.float())).sum(-1) / q.shape[-1] ** 0.5
        # E.g. ratio 4, queries at 6, 7, 8: 1, 2, 2 complete blocks.
        blocks_of = [(first + i + 1) // ratio for i in range(n)]
        for nb in sorted(set(blocks_of)):
            rows = torch.tensor([i for i, b in enumerate(blocks_of) if b == nb],
                                device=q.device)
            k = min(params.block_top_k, nb)
            if k:
                top = scores[rows, :nb].topk(k, dim=-1).indices  # [rows, k]
                picked = (top[..., None] * ratio + torch.arange(ratio, device=q.device))
                positions[rows, :k * ratio] = picked.flatten(1)
                valid[rows, :k * ratio] = True
            # The unfinished block, up to the query itself: always read.
            tail = torch.arange(ratio, device=q.device)
            q_pos = first + rows
            in_tail = nb * ratio + tail[None, :] <= q_pos[:, None]  # [rows, ratio]
            positions[rows, k * ratio:(k + 1) * ratio] = nb * ratio + tail
            valid[rows, k * ratio:(k + 1) * ratio] = in_tail
        out.append(Selection(positions, valid))
    return out


def qsa_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                  selections: list[Selection], scale: float) -> torch.Tensor:
    """q [T, Hq, D] over the K/V rows of each query's selection (this step's K/V already
    written); kv_cache [pages, per_page, 2, block, Hk, D]. Returns [T, Hq, D]. Quantized
    pages of rows per token are dequantized as gathered; q4 keys, quantized per channel
    over groups of tokens (AttentionMetadata.key_groups), are not read here."""
    if meta.key_groups:
        raise NotImplementedError("query-sparse attention on q4 K/V pages is not supported; "
                                  "use kv_cache_dtype int8, or auto")
    num_kv_heads = kv_cache.shape[-2]
    out = torch.empty_like(q)
    loc = meta.query_start_loc
    for r, sel in enumerate(selections):
        chosen, index = torch.unique(sel.positions[sel.valid], return_inverse=True)
        pages, slots, offsets = paged_rows(meta, r, chosen)
        keys, values = (from_page(kv_cache[pages, slots, half, offsets], meta, q.shape[-1],
                                  q.dtype) for half in (0, 1))
        slot = torch.zeros_like(sel.positions)
        slot[sel.valid] = index
        # [n, Hk, group, D] against [n, S, Hk, D]: query head h reads KV head h // group.
        qg = q[loc[r]:loc[r + 1]].unflatten(1, (num_kv_heads, -1))
        logits = torch.einsum("nkgd,nskd->nkgs", qg, keys[slot]) * scale
        logits = logits.masked_fill(~sel.valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1).to(q.dtype)
        out[loc[r]:loc[r + 1]] = torch.einsum("nkgs,nskd->nkgd", probs, values[slot]).flatten(1, 2)
    return out
