"""The chunked SSD form of the Mamba2 scan: the same numbers as the recurrence

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t (outer) B_t,     y_t = h_t . C_t

computed a chunk at a time with matrix products instead of a step per token. Within a chunk
(cs = cumulative sum of dt*A over the chunk):

    y_t   = sum_{s<=t} exp(cs_t - cs_s) (C_t . B_s) dt_s x_s   +   exp(cs_t) C_t . h_start
    h_end = exp(cs_last) h_start + sum_s exp(cs_last - cs_s) dt_s x_s (outer) B_s

Chunks end every `chunk_size` tokens and at every offset whose state must be saved, so a
state checkpoint is exactly the carried state there.
"""

from __future__ import annotations

import torch

_FLOOR = -80.0  # exp(-80) ~ 1.8e-35, well inside float32's normal range


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, state: torch.Tensor, *, chunk_size: int,
             save_at: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, H, P], dt [L, H], a [H], b/c [L, G, N] (G groups of H / G consecutive heads,
    each group's heads sharing its B and C), state [H, P, N] (all float32). Returns (y
    [L, H, P] without the D skip, the final state); writes the state after `offset` tokens
    into `save_at[offset]`.

    Heads lead every product, so each is one batched matrix product; C_t . B_s is taken
    once per group, not once per head."""
    num_tokens, heads, head_dim = x.shape
    groups, state_size = b.shape[1], b.shape[2]
    per = heads // groups
    edges = sorted({0, num_tokens, *range(chunk_size, num_tokens, chunk_size),
                    *(o for o in save_at if 0 < o < num_tokens)})
    longest = max((e1 - e0 for e0, e1 in zip(edges, edges[1:], strict=False)), default=0)
    above = torch.ones(longest, longest, dtype=torch.bool, device=x.device).triu(1)
    weighted = (x * dt[:, :, None]).transpose(0, 1)  # dt_s x_s  [H, L, P]
    bg, cg = b.transpose(0, 1), c.transpose(0, 1)  # [G, L, N]
    decay_rate = (dt * a).T  # [H, L]
    y = torch.empty_like(x)
    for start, end in zip(edges, edges[1:], strict=False):
        m = end - start
        cum = torch.cumsum(decay_rate[:, start:end], dim=1)  # [H, m]
        # decay[h, t, s] = exp(cum_t - cum_s) for s <= t, else 0. dt A <= 0, so the
        # differences on and below the diagonal are <= 0; those above (positive, they may
        # overflow) are clamped to 0 and zeroed after. Below _FLOOR they are raised to it:
        # exp there is under 2e-35, and a float exp whose result is subnormal or zero runs
        # 15-35x slower than a normal one (measured on an AVX2 core), which long chunks of
        # a fast-decaying head hit on most of their entries.
        diff = (cum[:, :, None] - cum[:, None, :]).clamp_(_FLOOR, 0.0)
        decay = torch.exp_(diff).masked_fill_(above[:m, :m], 0.0)
        bs, cs_, ws = bg[:, start:end], cg[:, start:end], weighted[:, start:end]
        scores = decay.view(groups, per, m, m) * torch.bmm(cs_, bs.transpose(1, 2))[:, None]
        y_chunk = torch.bmm(scores.view(heads, m, m), ws)  # [H, m, P]
        carried = torch.matmul(cs_[:, None], state.view(groups, per, head_dim, state_size)
                               .transpose(-1, -2))  # C_t . h_start  [G, per, m, P]
        y_chunk += carried.view(heads, m, head_dim) * torch.exp(cum)[:, :, None]
        y[start:end] = y_chunk.transpose(0, 1)
        to_end = torch.exp(cum[:, -1:] - cum)  # [H, m]
        gathered = (ws * to_end[:, :, None]).view(groups, per, m, head_dim).transpose(-1, -2)
        state = state * torch.exp(cum[:, -1])[:, None, None] + torch.matmul(
            gathered, bs[:, None]).view(heads, head_dim, state_size)
        if end in save_at:
            save_at[end].copy_(state.to(save_at[end].dtype))
    return y, state
