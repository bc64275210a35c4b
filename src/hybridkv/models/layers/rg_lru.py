"""Griffin's recurrent block (RecurrentGemma): a gated branch and a branch through a short
causal conv and the RG-LRU, a real-gated diagonal linear recurrence, with both states (the
conv's last inputs `[lru, width - 1]` and the recurrence `[lru]`, float32) in the KV arena.

    y = act(linear_y(h));   x = conv(linear_x(h))
    i_t = sigmoid(x_t W_i + b_i),  r_t = sigmoid(x_t W_r + b_r)     (block-diagonal per head)
    a_t = exp(-8 r_t softplus(c))
    s_t = a_t s_{t-1} + sqrt(1 - a_t^2) (i_t x_t)       (at position 0: s_t = i_t x_t)
    out = linear_out(s * y)
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.state import Saves, causal_conv, request_states
from hybridkv.worker.forward_context import ForwardContext


class RGLRU(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.block = num_heads, width // num_heads
        self.recurrent_param = nn.Parameter(torch.zeros(width))
        self.input_gate_weight = nn.Parameter(torch.zeros(num_heads, self.block, self.block))
        self.input_gate_bias = nn.Parameter(torch.zeros(num_heads, self.block))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(num_heads, self.block, self.block))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(num_heads, self.block))

    def _gate(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # x [L, width] -> per head x_h @ W_h + b_h -> [L, width]
        heads = x.unflatten(-1, (self.num_heads, self.block))
        return torch.sigmoid(torch.einsum("lhi,hio->lho", heads, weight) + bias).flatten(1)

    def scan(self, x: torch.Tensor, positions: torch.Tensor, state: torch.Tensor,
             saves: Saves) -> torch.Tensor:
        """x [L, width] from one request; `state` [width] is read and updated, and the state
        after `offset` tokens goes into each checkpoint of `saves`. Returns [L, width]."""
        input_gate = self._gate(x, self.input_gate_weight, self.input_gate_bias)
        recurrent_gate = self._gate(x, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * recurrent_gate * nn.functional.softplus(self.recurrent_param)
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        # A sequence start (position 0) resets the state and skips the normalisation.
        reset = (positions == 0)[:, None]
        multiplier = torch.where(reset, torch.ones_like(a_square), torch.sqrt(1 - a_square))
        inputs = (x * input_gate * multiplier.to(x.dtype)).float()
        a = (a * ~reset).float()
        save_at = {offset: saved for offset, _, saved in saves}
        s = state.float()
        out = torch.empty_like(x)
        for t in range(x.shape[0]):
            s = a[t] * s + inputs[t]
            out[t] = s.to(x.dtype)
            if t + 1 in save_at:
                save_at[t + 1].copy_(s.to(save_at[t + 1].dtype))
        state.copy_(s.to(state.dtype))
        return out


class RecurrentBlock(nn.Module):
    """forward(h [T, hidden], positions [T], ctx) -> [T, hidden]."""

    def __init__(self, hidden: int, width: int, conv_width: int, num_heads: int, act: str,
                 layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"  # the state layer's name in the KV layout
        self.native_ops = False  # the causal conv in C (state.causal_conv)
        self.linear_y = nn.Linear(hidden, width)
        self.linear_x = nn.Linear(hidden, width)
        self.linear_out = nn.Linear(width, hidden)
        self.conv_1d = nn.Conv1d(width, width, conv_width, groups=width)
        self.rg_lru = RGLRU(width, num_heads)
        self.act = activation(act)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        meta, states = ctx.state(self.name)
        y = self.act(self.linear_y(h))
        x = self.linear_x(h)
        out = torch.empty_like(x)
        for start, end, conv_state, lru_state, saves in request_states(meta, states):
            conv = causal_conv(x[start:end], conv_state, self.conv_1d, saves,
                               native=self.native_ops)
            out[start:end] = self.rg_lru.scan(conv, positions[start:end], lru_state, saves)
        return self.linear_out(out * y)  # type: ignore[no-any-return]
