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
from hybridkv.models.layers.state import causal_conv, state_places
from hybridkv.worker import cpu_ops
from hybridkv.worker.forward_context import ForwardContext


class ShortConv(nn.Module):
    def __init__(self, hidden: int, kernel: int, layer: int, *, bias: bool = False) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"  # the state layer's name in the KV layout
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.native_ops = False  # decode steps and prompts' convs in C (cpu_ops.py)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, (conv_states,) = ctx.state(self.name)
        bcx = self.in_proj(h)
        b, c, x = bcx.chunk(3, dim=-1)  # [T, hidden] each
        bx = b * x
        y = torch.empty_like(bx)
        steps = meta.plain_steps if self.native_ops and cpu_ops.takes(bcx) and \
            cpu_ops.conv_states_take(conv_states) else []
        if steps:
            # Single-token steps of all requests in one C call (C * conv(B * x) there; the
            # call models/native_decode.py makes, so a row is the same bytes on both paths).
            tokens = meta.plain_step_tokens(h.device)
            pages, slots = state_places(meta, steps, h.device)
            y[tokens] = cpu_ops.short_conv_decode(conv_states, pages, slots, bcx[tokens],
                                                  self.conv.weight, self.conv.bias)
        done = set(steps)
        for start, end, state, saves in request_single_states(meta, conv_states, skip=done):
            # causal_conv's checkpoints are (offset, conv state, SSM state): no SSM state here.
            y[start:end] = c[start:end] * causal_conv(
                bx[start:end], state, self.conv, [(offset, ckpt, ckpt) for offset, ckpt in saves],
                native=self.native_ops)
        return self.out_proj(y)  # type: ignore[no-any-return]

