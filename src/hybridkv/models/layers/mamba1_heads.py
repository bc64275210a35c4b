"""Zamba's Mamba1 mixer: the inner channels split into `n_mamba_heads` heads, each with its
own dt/B/C projection, otherwise the Mamba1 recurrence of layers/mamba1.py
    h_t = exp(dt_t A) * h_{t-1} + dt_t * B_t * x_t,   y_t = (h_t . C_t + D * x_t) * silu(z_t)
with B_t, C_t [state] per head instead of per layer. in_proj interleaves its outputs: channel
2i feeds x_i, channel 2i + 1 the gate z_i. The state is Mamba1's ([inner, state], conv
[inner, kernel - 1]); prompt chunks run `chunked_scan` once per head.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.mamba1 import chunked_scan
from hybridkv.models.layers.state import (
    Saves,
    causal_conv,
    conv_step,
    request_states,
    state_places,
)
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.state import StateMetadata


class MultiHeadMamba1Mixer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"
        self.native_ops = False  # the causal conv in C (state.causal_conv)
        hidden = int(cfg["hidden_size"])
        self.inner = int(cfg.get("mamba_expand", 2)) * hidden
        self.num_heads = int(cfg.get("n_mamba_heads", 2))
        if self.inner % self.num_heads:
            raise ValueError(f"n_mamba_heads ({self.num_heads}) must divide mamba_expand x "
                             f"hidden_size ({self.inner})")
        self.head_dim = self.inner // self.num_heads
        self.state_size = int(cfg.get("mamba_d_state", 16))
        rank = cfg.get("mamba_dt_rank", "auto")
        self.rank = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
        bias = bool(cfg.get("mamba_proj_bias", False))
        self.in_proj = nn.Linear(hidden, 2 * self.inner, bias=bias)
        self.conv1d = nn.Conv1d(self.inner, self.inner, int(cfg.get("mamba_d_conv", 4)),
                                groups=self.inner, bias=bool(cfg.get("mamba_conv_bias", True)))
        heads, head_dim = self.num_heads, self.head_dim
        self.x_proj_weight = nn.Parameter(torch.zeros(heads, self.rank + 2 * self.state_size,
                                                      head_dim))
        self.dt_proj_weight = nn.Parameter(torch.zeros(heads, head_dim, self.rank))
        self.dt_proj_bias = nn.Parameter(torch.zeros(heads, head_dim))
        self.A_log = nn.Parameter(torch.zeros(heads, head_dim, self.state_size))
        self.D = nn.Parameter(torch.ones(heads, head_dim))
        self.out_proj = nn.Linear(self.inner, hidden, bias=bias)
        self.act = activation(str(cfg.get("hidden_mamba_act", "silu")))

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, states = ctx.state(self.name)
        xz = self.in_proj(h).unflatten(-1, (self.inner, 2))  # [T, inner, (x, z)]
        x, z = xz[..., 0], xz[..., 1]
        y = torch.empty_like(x)
        batched = meta.plain_steps  # single-token steps: all at once
        if batched:
            tokens = meta.plain_step_tokens(h.device)
            y[tokens] = self._decode_batch(x[tokens], meta, batched, states)
        for start, end, conv_state, ssm_state, saves in request_states(meta, states,
                                                                        skip=batched):
            y[start:end] = self._request(x[start:end], conv_state, ssm_state, saves)
        return self.out_proj(y * nn.functional.silu(z))  # type: ignore[no-any-return]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [L, inner] after the conv -> dt [L, inner], b/c [L, heads, state], float32."""
        params = torch.einsum("lhp,hrp->lhr", x.unflatten(-1, (self.num_heads, -1)),
                              self.x_proj_weight)  # [L, heads, rank + 2 state]
        step, b, c = params.split([self.rank, self.state_size, self.state_size], -1)
        dt = torch.einsum("lhr,hpr->lhp", step, self.dt_proj_weight)  # [L, heads, head_dim]
        dt = nn.functional.softplus(dt.float() + self.dt_proj_bias.float())
        return dt.flatten(1), b.float(), c.float()

    def _decode_batch(self, x: torch.Tensor, meta: StateMetadata, rows: list[int],
                      states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One token for each of `rows`: x [R, inner] -> [R, inner]."""
        conv_states, ssm_states = states
        pages, slots = state_places(meta, rows, x.device)
        x = self.act(conv_step(x, conv_states, pages, slots, self.conv1d))
        dt, b, c = self._project(x)
        # Each head's B and C for all of its channels: [R, inner, state].
        b, c = (t.repeat_interleave(self.head_dim, dim=1) for t in (b, c))
        a = -torch.exp(self.A_log.float()).flatten(0, 1)  # [inner, state]
        xf = x.float()
        state = ssm_states[pages, slots].float()  # [R, inner, state]
        state = torch.exp(dt[:, :, None] * a) * state + (dt * xf)[:, :, None] * b
        ssm_states[pages, slots] = state.to(ssm_states.dtype)
        out = (state * c).sum(-1)
        return (out + xf * self.D.float().flatten()).to(x.dtype)

    def _request(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                 saves: Saves) -> torch.Tensor:
        x = self.act(causal_conv(x, conv_state, self.conv1d, saves,
                                 native=self.native_ops))  # [L, inner]
        dt, b, c = self._project(x)
        a = -torch.exp(self.A_log.float()).flatten(0, 1)  # [inner, state]
        xf = x.float()
        out = torch.empty_like(xf)
        for head in range(self.num_heads):
            # E.g. head 1 of 2 over 128 channels: channels 64..127 and their states.
            ch = slice(head * self.head_dim, (head + 1) * self.head_dim)
            save_at = {offset: ssm[ch] for offset, _, ssm in saves}
            out[:, ch], state = chunked_scan(dt[:, ch], a[ch], xf[:, ch], b[:, head],
                                             c[:, head], ssm_state[ch].float(), save_at)
            ssm_state[ch] = state.to(ssm_state.dtype)
        return (out + xf * self.D.float().flatten()).to(x.dtype)
