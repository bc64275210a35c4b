"""Attention whose scores depend on the query token beyond q . k: a relative bias per query
and a sink logit per query (Inkling's and Inkling 2's attention), on the torch reference
path. The "cpu" backend's C kernel computes the same in place (hkv_paged_attention_scored)
and sends here only what it does not take (soft-capped scores, q4 K/V pages).

For the query at position p (row t of the step) and a key at position j, d = p - j:

    score(t, h, j) = scale * q[t, h] . k[j, h]
                     + (query_bias[t, h, d] if 0 <= d < E else 0)     # E: the bias extent
    probs = softmax([score(t, h, j) for visible j] + [token_sinks[t, h]])[:-1]

A sink takes probability mass and contributes no value. Queries go in blocks of the window
(or QUERY_BLOCK for full layers), each over only the keys it can see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridkv.worker.attention.backend import AttentionParams

# Queries scored at once on a full-attention layer: bounds the [H, block, L] scores.
QUERY_BLOCK = 256


def attend_scored(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int,
                  params: AttentionParams, query_bias: torch.Tensor | None,
                  token_sinks: torch.Tensor | None) -> torch.Tensor:
    """q [nq, Hq, D]: the last nq positions of a sequence of seq_len; keys/values [seq_len,
    Hk, D]; query_bias [nq, Hq, E] and token_sinks [nq, Hq] (each or None) of those queries.
    Returns [nq, Hq, D]."""
    if params.chunk_size is not None:
        raise NotImplementedError("a per-query relative bias or sink with chunked attention")
    num_q = q.shape[0]
    first = seq_len - num_q
    step = params.sliding_window or QUERY_BLOCK
    out = torch.empty_like(q)
    for a in range(0, num_q, step):
        b = min(num_q, a + step)
        k_start = 0 if params.sliding_window is None else \
            max(0, first + a - params.sliding_window + 1)
        k_end = first + b  # the block's last query sees keys up to its own position
        out[a:b] = _scored_block(
            q[a:b], keys[k_start:k_end], values[k_start:k_end], first + a, k_start, params,
            None if query_bias is None else query_bias[a:b],
            None if token_sinks is None else token_sinks[a:b])
    return out


def _scored_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int,
                  k_start: int, params: AttentionParams, query_bias: torch.Tensor | None,
                  token_sinks: torch.Tensor | None) -> torch.Tensor:
    """Queries at positions q_start.. over keys at positions k_start.., in float32."""
    num_q, num_heads = q.shape[0], q.shape[1]
    group = num_heads // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    q_pos = torch.arange(q_start, q_start + num_q, device=q.device)[:, None]
    k_pos = torch.arange(k_start, k_start + keys.shape[0], device=q.device)[None, :]
    distance = q_pos - k_pos  # [nq, L]
    allowed = distance >= 0
    if params.sliding_window is not None:
        allowed &= distance < params.sliding_window
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    if query_bias is not None:
        extent = query_bias.shape[-1]
        # [Hq, nq, E] gathered at each key's distance -> [Hq, nq, L]; zero past the extent.
        index = distance.clamp(0, extent - 1).expand(num_heads, -1, -1)
        bias = query_bias.float().permute(1, 0, 2).gather(-1, index)
        scores = scores + bias.masked_fill((distance < 0) | (distance >= extent), 0.0)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if token_sinks is not None:
        sink = token_sinks.float().T[:, :, None]  # [Hq, nq, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    elif params.sinks is not None:
        sink = params.sinks.float().view(num_heads, 1, 1).expand(num_heads, num_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)
