"""The Mamba1 mixer (Jamba's), with its state in the KV cache arena.

Mamba1 keeps one SSM state per channel, `[inner, state]`, with input-dependent dt, B and C
(each RMS-normalised in Jamba):
    h_t = exp(dt_t A) * h_{t-1} + dt_t * B_t * x_t,   y_t = (h_t . C_t + D * x_t) * silu(z_t)
Prompt chunks run the scan in its chunked form (`chunked_scan`: a chunk of tokens in a few
tensor operations, every state inside it computed, so checkpoints fall on any token);
single-token steps of all requests go in one batched update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.state import (
    Saves,
    causal_conv,
    conv_step,
    request_states,
    state_places,
)
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.state import StateMetadata


class Mamba1Mixer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"
        self.native_ops = False  # the causal conv in C (state.causal_conv)
        hidden = int(cfg["hidden_size"])
        self.inner = int(cfg.get("mamba_expand", 2)) * hidden
        self.state_size = int(cfg.get("mamba_d_state", 16))
        self.rank = int(cfg.get("mamba_dt_rank") or -(-hidden // 16))
        kernel = int(cfg.get("mamba_d_conv", 4))
        proj_bias = bool(cfg.get("mamba_proj_bias", False))
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.in_proj = nn.Linear(hidden, 2 * self.inner, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.inner, self.inner, kernel, groups=self.inner,
                                bias=bool(cfg.get("mamba_conv_bias", True)))
        self.x_proj = nn.Linear(self.inner, self.rank + 2 * self.state_size, bias=False)
        self.dt_proj = nn.Linear(self.rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.state_size))
        self.D = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, hidden, bias=proj_bias)
        self.dt_layernorm = RMSNorm(self.rank, eps)
        self.b_layernorm = RMSNorm(self.state_size, eps)
        self.c_layernorm = RMSNorm(self.state_size, eps)
        self.act = activation(str(cfg.get("hidden_act", "silu")))

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, states = ctx.state(self.name)
        x, z = self.in_proj(h).chunk(2, dim=-1)  # [T, inner] each
        y = torch.empty_like(x)
        batched = meta.plain_steps  # single-token steps: all at once
        if batched:
            tokens = meta.plain_step_tokens(h.device)
            y[tokens] = self._decode_batch(x[tokens], meta, batched, states)
        for start, end, conv_state, ssm_state, saves in request_states(meta, states,
                                                                        skip=batched):
            y[start:end] = self._request(x[start:end], conv_state, ssm_state, saves)
        return self.out_proj(y * nn.functional.silu(z))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [L, inner] after the conv -> dt [L, inner], b/c [L, state], all float32."""
        dt, b, c = self.x_proj(x).split([self.rank, self.state_size, self.state_size], -1)
        dt = self.dt_layernorm(dt) @ self.dt_proj.weight.T  # [L, inner], bias added below
        dt = nn.functional.softplus(dt.float() + self.dt_proj.bias.float())
        return dt, self.b_layernorm(b).float(), self.c_layernorm(c).float()

    def _decode_batch(self, x: torch.Tensor, meta: StateMetadata, rows: list[int],
                      states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One token for each of `rows`: x [R, inner] -> [R, inner]."""
        conv_states, ssm_states = states
        pages, slots = state_places(meta, rows, x.device)
        x = self.act(conv_step(x, conv_states, pages, slots, self.conv1d))
        dt, b, c = self._project(x)
        a = -torch.exp(self.A_log.float())  # [inner, state]
        xf = x.float()
        state = ssm_states[pages, slots].float()  # [R, inner, state]
        state = torch.exp(dt[:, :, None] * a) * state + \
            (dt * xf)[:, :, None] * b[:, None, :]
        ssm_states[pages, slots] = state.to(ssm_states.dtype)
        out = torch.einsum("rin,rn->ri", state, c)
        return (out + xf * self.D.float()).to(x.dtype)

    def _request(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                 saves: Saves) -> torch.Tensor:
        x = self.act(causal_conv(x, conv_state, self.conv1d, saves,
                                 native=self.native_ops))  # [L, inner]
        dt, b, c = self._project(x)  # [L, inner], [L, state], [L, state]
        a = -torch.exp(self.A_log.float())  # [inner, state]
        xf = x.float()
        save_at = {offset: ssm for offset, _, ssm in saves}
        out, state = chunked_scan(dt, a, xf, b, c, ssm_state.float(), save_at)
        ssm_state.copy_(state.to(ssm_state.dtype))
        return (out + xf * self.D.float()).to(x.dtype)


# Elements of the [m, m, inner, state] decay tensor of one chunk at most: bounds the chunk
# length m (the chunked form does m times the work of the token loop, in a few large
# operations instead of several small ones per token). Timed on a 2,048-token prefill on
# one core: inner 128 (state 16) is fastest at m = 3-4 (0.36-0.47 s; m = 32 took 3.4 s),
# inner 1,024 at m = 1 (1.1 s; m = 16, what a bound of 2^22 gave, took 10.2 s).
_CHUNK_ELEMENTS = 1 << 15
_MAX_CHUNK = 32


def chunked_scan(dt: torch.Tensor, a: torch.Tensor, x: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor, state: torch.Tensor, save_at: dict[int, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba1 recurrence a chunk of m tokens at a time: dt/x [L, inner], a [inner, N],
    b/c [L, N], state [inner, N] (float32). Within a chunk, with cum_t = sum_{s<=t} dt_s A,

        h_t = exp(cum_t) h_start + sum_{s<=t} exp(cum_t - cum_s) dt_s x_s B_s,   y_t = h_t C_t

    (every exponent <= 0: no overflow). Returns (y [L, inner] without the D skip, the final
    state); writes the state after `offset` tokens into `save_at[offset]`."""
    num_tokens, inner = x.shape
    size = max(1, min(_MAX_CHUNK, int((_CHUNK_ELEMENTS / a.numel()) ** 0.5)))
    y = torch.empty_like(x)
    for start in range(0, num_tokens, size):
        end = min(start + size, num_tokens)
        m = end - start
        cum = torch.cumsum(dt[start:end, :, None] * a, dim=0)  # [m, inner, N]
        u = (dt[start:end] * x[start:end])[:, :, None] * b[start:end, None, :]  # [m, i, N]
        causal = torch.ones(m, m, dtype=torch.bool, device=x.device).tril()
        diff = (cum[:, None] - cum[None, :]).masked_fill(~causal[:, :, None, None],
                                                           float("-inf"))
        states = torch.einsum("tsin,sin->tin", torch.exp(diff), u) + \
            torch.exp(cum) * state  # [m, inner, N]: the state after each token
        y[start:end] = torch.einsum("tin,tn->ti", states, c[start:end])
        for offset, checkpoint in save_at.items():
            if start < offset <= end:
                checkpoint.copy_(states[offset - start - 1].to(checkpoint.dtype))
        state = states[-1]
    return y, state
