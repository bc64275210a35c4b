"""Lightning attention (MiniMax): linear attention with a fixed decay per head, its
`[heads, head_dim, head_dim]` state in the KV cache arena.

    q, k, v = act(qkv_proj(h))                    # per head
    S_t = exp(-slope) S_{t-1} + k_t^T v_t,   o_t = q_t S_t
    out = out_proj(sigmoid(output_gate(h)) * norm(o))

The reference computes prefill in blocks (intra-block decay matrix + decayed carry); that
is this recurrence regrouped. Each layer's slope is ALiBi's geometric series over heads,
scaled down linearly with depth.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.single_state import request_single_states
from hybridkv.worker.forward_context import ForwardContext


def slope_rates(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """[heads] decay rates: (2^(-8/heads))^(h+1), times 1 - layer / (layers - 1) (+ eps)."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float32) + 1)
    return rate * (1 - layer / (num_layers - 1 + 1e-5) + 1e-5)


class LightningAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, head_dim: int, act: str, eps: float,
                 layer: int, num_layers: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"  # the state layer's name in the KV layout
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * width, bias=False)
        self.output_gate = nn.Linear(hidden, width, bias=False)
        self.out_proj = nn.Linear(width, hidden, bias=False)
        self.norm = RMSNorm(width, eps)
        self.act = activation(act)
        self.decay: torch.Tensor
        self.register_buffer("decay", torch.exp(-slope_rates(num_heads, layer, num_layers)),
                             persistent=False)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, (states,) = ctx.state(self.name)
        qkv = self.act(self.qkv_proj(h)).unflatten(-1, (self.num_heads, 3 * self.head_dim))
        q, k, v = qkv.float().split(self.head_dim, dim=-1)  # [T, heads, head_dim] each
        out = torch.empty_like(q)
        decay = self.decay[:, None, None]
        for start, end, state, saves in request_single_states(meta, states):
            save_at = dict(saves)
            s = state.float()  # [heads, head_dim (k), head_dim (v)]
            for t in range(start, end):
                s = decay * s + k[t][:, :, None] * v[t][:, None, :]
                out[t] = (q[t][:, :, None] * s).sum(dim=1)
                if t + 1 - start in save_at:
                    save_at[t + 1 - start].copy_(s.to(state.dtype))
            state.copy_(s.to(state.dtype))
        gated = torch.sigmoid(self.output_gate(h)) * self.norm(out.flatten(1).to(h.dtype))
        return self.out_proj(gated)  # type: ignore[no-any-return]
