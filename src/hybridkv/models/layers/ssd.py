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


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, state: torch.Tensor, *, chunk_size: int,
             save_at: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, H, P], dt [L, H], a [H], b/c [L, H, N], state [H, P, N] (all float32).
    Returns (y [L, H, P] without the D skip, the final state); writes the state after
    `offset` tokens into `save_at[offset]`."""
    num_tokens = x.shape[0]
    edges = sorted({0, num_tokens, *range(chunk_size, num_tokens, chunk_size),
                    *(o for o in save_at if 0 < o < num_tokens)})
    y = torch.empty_like(x)
    for start, end in zip(edges, edges[1:], strict=False):
        xs, dts, bs, cs_ = x[start:end], dt[start:end], b[start:end], c[start:end]
        cum = torch.cumsum(dts * a, dim=0)  # [m, H]
        # decay[t, s, h] = exp(cum_t - cum_s) for s <= t, else 0 (masked before exp).
        diff = cum[:, None, :] - cum[None, :, :]
        causal = torch.ones(end - start, end - start, dtype=torch.bool,
                            device=x.device).tril()
        decay = torch.exp(diff.masked_fill(~causal[:, :, None], float("-inf")))
        scores = torch.einsum("thn,shn->tsh", cs_, bs) * decay  # [m, m, H]
        weighted = xs * dts[:, :, None]  # dt_s x_s  [m, H, P]
        y_chunk = torch.einsum("tsh,shp->thp", scores, weighted)
        y_chunk += torch.einsum("thn,hpn->thp", cs_, state) * torch.exp(cum)[:, :, None]
        y[start:end] = y_chunk
        to_end = torch.exp(cum[-1][None, :] - cum)  # [m, H]
        state = state * torch.exp(cum[-1])[:, None, None] + torch.einsum(
            "sh,shp,shn->hpn", to_end, weighted, bs)
        if end in save_at:
            save_at[end].copy_(state.to(save_at[end].dtype))
    return y, state
