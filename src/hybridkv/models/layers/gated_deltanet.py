"""Gated DeltaNet (Qwen3-Next's linear attention), with a fixed-size state per request in the
KV cache arena.

Gated delta rule, per value head, with q and k L2-normalised (q also by 1/sqrt(d_k)):
    S <- S * exp(g_t);   S <- S + k_t (outer) ((v_t - S^T k_t) * beta_t);   o_t = S^T q_t
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.norms import l2_normalize
from hybridkv.models.layers.state import (
    Saves,
    causal_conv,
    conv_step,
    request_states,
    state_places,
)
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.state import StateMetadata


class HeadNormWeight(nn.Module):
    """The weight of the gated per-head norm (applied in `GatedDeltaNet.forward`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"
        hidden = int(cfg["hidden_size"])
        self.num_k_heads = int(cfg["linear_num_key_heads"])
        self.num_v_heads = int(cfg["linear_num_value_heads"])
        self.k_dim = int(cfg["linear_key_head_dim"])
        self.v_dim = int(cfg["linear_value_head_dim"])
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        conv_dim = 2 * self.key_size + self.value_size
        kernel = int(cfg.get("linear_conv_kernel_dim", 4))
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False)
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_size + 2 * self.value_size,
                                      bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = HeadNormWeight(self.v_dim)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)
        self.act = activation(str(cfg.get("hidden_act", "silu")))

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor
               ) -> tuple[torch.Tensor, ...]:
        """The projections are laid out per key head: [q, k, v..., z...] and [b..., a...]."""
        tokens = qkvz.shape[0]
        per = self.num_v_heads // self.num_k_heads
        q, k, v, z = qkvz.view(tokens, self.num_k_heads, -1).split(
            [self.k_dim, self.k_dim, per * self.v_dim, per * self.v_dim], dim=-1)
        b, a = ba.view(tokens, self.num_k_heads, -1).split([per, per], dim=-1)
        return (q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1),
                z.reshape(tokens, self.num_v_heads, self.v_dim),
                b.reshape(tokens, self.num_v_heads), a.reshape(tokens, self.num_v_heads))

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, states = ctx.state(self.name)
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(h), self.in_proj_ba(h))
        mixed = torch.cat([q, k, v], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias)
        out = torch.empty(h.shape[0], self.num_v_heads, self.v_dim, device=h.device)
        batched = meta.plain_steps  # single-token steps: all at once
        if batched:
            tokens = torch.tensor([meta.query_start_loc[r] for r in batched], device=h.device)
            out[tokens] = self._decode_batch(mixed[tokens], beta[tokens], g[tokens], meta,
                                             batched, states)
        for start, end, conv_state, state, saves in request_states(meta, states,
                                                                   skip=batched):
            out[start:end] = self._request(mixed[start:end], beta[start:end], g[start:end],
                                           conv_state, state, saves)
        # Gated norm per value head: normalise, weight, then gate with silu(z).
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        gated = (self.norm.weight * normed.to(h.dtype)).float() * nn.functional.silu(z.float())
        return self.out_proj(gated.to(h.dtype).flatten(1))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [L, conv_dim] after the conv -> q, k [L, v_heads, k_dim] (L2-normalised, q also
        by 1/sqrt(k_dim)), v [L, v_heads, v_dim], float32."""
        q, k, v = x.float().split([self.key_size, self.key_size, self.value_size], dim=-1)
        per = self.num_v_heads // self.num_k_heads
        q = l2_normalize(q.unflatten(-1, (self.num_k_heads, self.k_dim))).repeat_interleave(
            per, 1)
        k = l2_normalize(k.unflatten(-1, (self.num_k_heads, self.k_dim))).repeat_interleave(
            per, 1)
        return q / self.k_dim ** 0.5, k, v.unflatten(-1, (self.num_v_heads, self.v_dim))

    def _decode_batch(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                      meta: StateMetadata, rows: list[int],
                      states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One token for each of `rows`: mixed [R, conv_dim], beta/g [R, v_heads] ->
        [R, v_heads, v_dim]."""
        conv_states, ssm_states = states
        pages, slots = state_places(meta, rows, mixed.device)
        q, k, v = self._qkv(self.act(conv_step(mixed, conv_states, pages, slots,
                                               self.conv1d)))
        s = ssm_states[pages, slots].float() * g.exp()[:, :, None, None]  # [R, vh, kd, vd]
        memory = (s * k[..., None]).sum(dim=2)  # [R, v_heads, v_dim]
        delta = (v - memory) * beta[..., None]
        s = s + k[..., None] * delta[:, :, None, :]
        ssm_states[pages, slots] = s.to(ssm_states.dtype)
        return (s * q[..., None]).sum(dim=2)

    def _request(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                 conv_state: torch.Tensor, state: torch.Tensor,
                 saves: Saves) -> torch.Tensor:
        x = self.act(causal_conv(mixed, conv_state, self.conv1d, saves))
        q, k, v = self._qkv(x)
        save_at = {offset: ssm for offset, _, ssm in saves}
        s = state.float()  # [v_heads, k_dim, v_dim]
        out = torch.empty(x.shape[0], self.num_v_heads, self.v_dim, device=x.device)
        for t in range(x.shape[0]):
            s = s * g[t].exp()[:, None, None]
            memory = (s * k[t][:, :, None]).sum(dim=1)  # [v_heads, v_dim]
            delta = (v[t] - memory) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = (s * q[t][:, :, None]).sum(dim=1)
            if t + 1 in save_at:
                save_at[t + 1].copy_(s.to(state.dtype))
        state.copy_(s.to(state.dtype))
        return out
