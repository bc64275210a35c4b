"""A gated short convolution (LFM2's `conv` operator), with its state in the KV cache arena.

    B, C, x = in_proj(h)                       # each [T, hidden]
    y = C * causal_depthwise_conv(B * x)       # kernel `L_cache`, per channel
    out = out_proj(y)

The state is the conv's last `L_cache - 1` inputs, `[hidden, L_cache - 1]`, one block per
request like a Mamba state (a MambaSpec with a single shape); checkpoints at block-aligned
positions are the conv window there, so prefix hits and branch points work as for SSMs.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.single_state import request_single_states
from hybridkv.models.layers.state import causal_conv
from hybridkv.worker.forward_context import ForwardContext


class ShortConv(nn.Module):
    def __init__(self, hidden: int, kernel: int, layer: int, *, bias: bool = False) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"  # the state layer's name in the KV layout
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, (conv_states,) = ctx.state(self.name)
        b, c, x = self.in_proj(h).chunk(3, dim=-1)  # [T, hidden] each
        bx = b * x
        y = torch.empty_like(bx)
        for start, end, state, saves in request_single_states(meta, conv_states):
            # causal_conv's checkpoints are (offset, conv state, SSM state): no SSM state here.
            y[start:end] = causal_conv(bx[start:end], state, self.conv,
                                       [(offset, ckpt, ckpt) for offset, ckpt in saves])
        return self.out_proj(c * y)  # type: ignore[no-any-return]

