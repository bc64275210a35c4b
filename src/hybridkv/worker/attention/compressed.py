"""Compressed attention (DeepSeek-V4): each query attends to its sliding window of K=V rows
and to compressed entries, each entry one K=V row summarising a window of `rate` tokens, with
a learned sink logit per head beside them:

    sliding rows  [pages, per_page, block, D]            one per token (the window's group)
    entries       [pages, per_page, block // rate, D]    entry w covers tokens [w r, (w+1) r)
    query at p    reads rows (p - window, p] and the entries of closed windows,
                  w < (p + 1) // rate: all of them (HCA), or the top k its lightning indexer
                  scores highest (CSA; the indexer's keys are entries of their own group)
    out(p)        = softmax over [q . rows, q . entries, sink] x scale, applied to the rows

An entry's place follows from its first token's: token w r lies in block (w r) // block of the
group's table, and the entry at (offset in the block) // rate; a block of B x rate tokens holds
B entries, so a block boundary is a window boundary.

Ties. The indexer's scores are relu'd, so many are exactly 0 in small models, and which of
equal scores torch.topk keeps depends on the row it sees. transformers scores a prompt's
queries over a row of the prompt's entries (later ones -inf) and a generated token at p over
(p + 1) // rate entries; rows are built the same way here (AttentionMetadata.prompt_lens), so a
query selects the same entries however its prompt was chunked, cached or recomputed. This is
the torch path, request by request: meant for small models and as the reference for kernels.
"""

from __future__ import annotations

import torch

from hybridkv.worker.attention.backend import AttentionMetadata
from hybridkv.worker.attention.sparse_mla import paged_rows


def entry_places(meta: AttentionMetadata, row: int, entries: torch.Tensor, rate: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(page, slot, index in the block) of request `row`'s entries [m] in an entry group's
    view (CompressedAttentionSpec, IndexerKeySpec with compress_rate `rate`)."""
    pages, slots, offsets = paged_rows(meta, row, entries * rate)
    return pages, slots, offsets // rate


def write_entries(view: torch.Tensor, meta: AttentionMetadata, row: int, first: int,
                  entries: torch.Tensor, rate: int) -> None:
    """Entries [m, D] of request `row`, the first being entry `first`, into their places."""
    index = torch.arange(first, first + entries.shape[0], device=entries.device)
    view[entry_places(meta, row, index, rate)] = entries.to(view.dtype)


def read_entries(view: torch.Tensor, meta: AttentionMetadata, row: int, count: int,
                 rate: int) -> torch.Tensor:
    """Request `row`'s first `count` entries, [count, D]."""
    index = torch.arange(count, device=view.device)
    return view[entry_places(meta, row, index, rate)]


def indexer_top_k(scores: torch.Tensor, first: int, prompt_len: int, rate: int,
                  top_k: int) -> torch.Tensor:
    """Which entries each query reads: scores [n, E] of queries at positions first..first+n-1
    over the request's E entries -> a mask [n, E]. Each row is laid out as transformers lays
    it out (the module docstring) before torch.topk, so ties fall the same way; picks past a
    query's closed windows are dropped, as its indexer drops them (-1)."""
    n, count = scores.shape
    q_pos = first + torch.arange(n, device=scores.device)
    closed = (q_pos + 1) // rate  # entries each query may read
    chosen = torch.zeros(n, count, dtype=torch.bool, device=scores.device)
    row_lens = [max(prompt_len // rate, (first + i + 1) // rate) for i in range(n)]
    for row_len in sorted(set(row_lens)):
        k = min(top_k, row_len)
        if k == 0:
            continue
        rows = torch.tensor([i for i, m in enumerate(row_lens) if m == row_len],
                            device=scores.device)
        full = scores.new_full((len(rows), row_len), float("-inf"))
        width = min(row_len, count)
        full[:, :width] = scores[rows, :width]
        future = torch.arange(row_len, device=scores.device)[None, :] >= closed[rows, None]
        full.masked_fill_(future, float("-inf"))
        picked = full.topk(k, dim=-1).indices  # [rows, k]
        valid = picked < closed[rows, None]
        # Dropped picks go to a spare last column, so they never overwrite a kept one.
        spare = max(row_len, count)
        hit = torch.zeros(len(rows), spare + 1, dtype=torch.bool, device=scores.device)
        hit.scatter_(1, torch.where(valid, picked, torch.full_like(picked, spare)), True)
        chosen[rows] = hit[:, :count]
    return chosen


def sliding_rows(view: torch.Tensor, meta: AttentionMetadata, row: int, lo: int, hi: int
                 ) -> torch.Tensor:
    """Request `row`'s K=V rows of positions [lo, hi), [hi - lo, D]."""
    return view[paged_rows(meta, row, torch.arange(lo, hi, device=view.device))]


def compressed_attention(q: torch.Tensor, rows: torch.Tensor, row_pos: torch.Tensor,
                         entries: torch.Tensor, entry_mask: torch.Tensor,
                         q_pos: torch.Tensor, window: int, sinks: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """One request: q [n, H, D] at positions q_pos [n] over its sliding rows [L, D] at
    row_pos [L] (those within the window of each query are read) and its entries [E, D]
    (entry_mask [n, E]: which each query reads), with a sink logit per head [H].
    Returns [n, H, D] in q's dtype."""
    keys = torch.cat([rows.to(q.dtype), entries.to(q.dtype)], dim=0)  # K = V
    in_window = (row_pos[None, :] <= q_pos[:, None]) & (row_pos[None, :] > q_pos[:, None] - window)
    visible = torch.cat([in_window, entry_mask], dim=1)  # [n, L + E]
    logits = torch.einsum("nhd,ld->nhl", q, keys) * scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    # The sinks' dtype (float32 where the model keeps them so) joins the softmax's.
    dtype = torch.promote_types(logits.dtype, sinks.dtype)
    sink = sinks.to(dtype)[None, :, None].expand(q.shape[0], -1, 1)
    combined = torch.cat([logits.to(dtype), sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype)
    return torch.einsum("nhl,ld->nhd", probs, keys)
