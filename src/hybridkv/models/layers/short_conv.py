"""A gated short convolution (LFM2's `conv` operator), with its state in the KV cache arena.

    B, C, x = in_proj(h)                       # each [T, hidden]
    y = C * causal_depthwise_conv(B * x)       # kernel `L_cache`, per channel
    out = out_proj(y)

The state is the conv's last `L_cache - 1` inputs, `[hidden, L_cache - 1]`, one block per
request like a Mamba state (a MambaSpec with a single shape); checkpoints at block-aligned
positions are the conv window there, so prefix hits and branch points work as for SSMs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from hybridkv.models.layers.state import causal_conv
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.state import StateMetadata


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
        for start, end, state, saves in _request_states(meta, conv_states):
            # causal_conv's checkpoints are (offset, conv state, SSM state): no SSM state here.
            y[start:end] = causal_conv(bx[start:end], state, self.conv,
                                       [(offset, ckpt, ckpt) for offset, ckpt in saves])
        return self.out_proj(c * y)  # type: ignore[no-any-return]


def _request_states(meta: StateMetadata, conv_states: torch.Tensor
                    ) -> Iterator[tuple[int, int, torch.Tensor, list[tuple[int, torch.Tensor]]]]:
    """Per request with tokens this step: (start, end, its live conv state made ready,
    checkpoints to fill as (offset, state)). The live state is restored from a prefix-hit
    checkpoint, zeroed for a fresh start, or left to continue (as layers/state.py does for
    two-part states)."""
    for r in range(len(meta.state_pages)):
        start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
        if start == end:
            continue
        state = conv_states[meta.state_pages[r], meta.state_slots[r]]
        source = meta.init_from[r]
        if source is not None:
            state.copy_(conv_states[source])
        elif not meta.has_initial_state[r]:
            state.zero_()
        yield start, end, state, [(offset, conv_states[p, s])
                                  for offset, p, s in meta.checkpoints[r]]
