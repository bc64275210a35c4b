"""Gated DeltaNet (Qwen3-Next's linear attention), with a fixed-size state per request in the
KV cache arena.

Gated delta rule, per value head, with q and k L2-normalised (q also by 1/sqrt(d_k)):
    S <- S * exp(g_t);   S <- S + k_t (outer) ((v_t - S^T k_t) * beta_t);   o_t = S^T q_t
Prompt chunks run it in chunked form (`chunked_delta_rule`); single-token steps of all
requests go in one batched update.

beta_t = sigmoid(b_t) in Qwen3-Next/Qwen3.5; OLMo Hybrid may scale it by 2
(`linear_allow_neg_eigval`), so that I - beta k k^T can have a negative eigenvalue:
`beta_scale=2.0`. The gated output norm's eps is the config's `rms_norm_eps` unless
`norm_eps` says otherwise (OLMo Hybrid: 1e-5).
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
from hybridkv.worker import cpu_ops
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.state import StateMetadata


class HeadNormWeight(nn.Module):
    """The weight of the gated per-head norm (applied in `GatedDeltaNet.forward`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, *, beta_scale: float = 1.0,
                 norm_eps: float | None = None) -> None:
        super().__init__()
        self.beta_scale = beta_scale
        self.name = f"model.layers.{layer}.mamba"
        self.native_ops = False  # the causal conv and decode steps in C (cpu_ops.py)
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
        self.eps = float(cfg.get("rms_norm_eps", 1e-6)) if norm_eps is None else norm_eps
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
        beta, g = self._gates(b, a)
        out = torch.empty(h.shape[0], self.num_v_heads, self.v_dim, device=h.device)
        batched = meta.plain_steps  # single-token steps: all at once
        if batched:
            tokens = meta.plain_step_tokens(h.device)
            out[tokens] = self._decode_batch(mixed[tokens], beta[tokens], g[tokens], meta,
                                             batched, states)
        for start, end, conv_state, state, saves in request_states(meta, states,
                                                                   skip=batched):
            out[start:end] = self._request(mixed[start:end], beta[start:end], g[start:end],
                                           conv_state, state, saves)
        return self._output(out, z, h.dtype)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(beta, g) [T, v_heads] float32 from the b and a projections [T, v_heads]."""
        a_neg = -self.A_log.float().exp()
        if self.native_ops and b.dim() == a.dim() == 2 and all(
                cpu_ops.takes(t) for t in (b, a, self.dt_bias)) and self.dt_bias.is_contiguous():
            # One C call, the one models/native_decode.py makes (the same bytes there).
            return cpu_ops.gdn_gates(b, a, self.dt_bias, a_neg, self.beta_scale)
        beta = torch.sigmoid(b.float())
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        return beta, a_neg * nn.functional.softplus(a.float() + self.dt_bias)

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The recurrence's out [T, v_heads, v_dim] through the gated norm and out_proj."""
        weight = self.norm.weight
        if self.native_ops and dtype == torch.float32 and \
                cpu_ops.gated_head_norm_takes(out, z, weight):
            return self.out_proj(  # type: ignore[no-any-return]
                cpu_ops.gated_head_norm(out, z, weight, self.eps))
        return self.out_proj(  # type: ignore[no-any-return]
            gated_head_norm(out, z, weight, self.eps, dtype))

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
        if self.native_ops and self.act is nn.functional.silu and self.conv1d.bias is None and \
                cpu_ops.takes(mixed) and cpu_ops.decode_states_take(conv_states, ssm_states):
            # The whole step below in one C call, both states updated in place.
            return cpu_ops.gdn_decode(conv_states, ssm_states, pages, slots, mixed, beta, g,
                                      self.conv1d.weight, self.num_k_heads)
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
        x = self.act(causal_conv(mixed, conv_state, self.conv1d, saves,
                                 native=self.native_ops))
        q, k, v = self._qkv(x)
        save_at = {offset: ssm for offset, _, ssm in saves}
        out, s = chunked_delta_rule(q, k, v, beta, g, state.float(), save_at)
        state.copy_(s.to(state.dtype))
        return out


def gated_head_norm(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """The gated norm per value head: normalise out [T, v_heads, v_dim] (float32), weight,
    then gate with silu(z). Returns [T, v_heads * v_dim] in `dtype`."""
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    gated = (weight * normed.to(dtype)).float() * nn.functional.silu(z.float())
    return gated.to(dtype).flatten(1)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                       g: torch.Tensor, state: torch.Tensor, save_at: dict[int, torch.Tensor],
                       chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule a chunk at a time: q/k [L, H, dk], v [L, H, dv], beta/g [L, H],
    state [H, dk, dv] (float32). Returns (o [L, H, dv], the final state); writes the state
    after `offset` tokens into `save_at[offset]` (chunks end there).

    Per token S_t = exp(g_t) S_{t-1} + k_t d_t^T with d_t = beta_t (v_t - exp(g_t) S_{t-1}^T
    k_t). Within a chunk starting from S_0, with G_t = g_1 + ... + g_t (all <= 0):
        S_t = exp(G_t) S_0 + sum_{s<=t} exp(G_t - G_s) k_s d_s^T
    so the d_t solve one unit lower-triangular system,
        (I + diag(beta) A) d = diag(beta) (v - diag(exp(G)) K S_0),
        A[t, s] = exp(G_t - G_s) k_t.k_s for s < t,
    and o_t = exp(G_t) S_0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) d_s."""
    num_tokens = q.shape[0]
    edges = sorted({0, num_tokens, *range(chunk_size, num_tokens, chunk_size),
                    *(o for o in save_at if 0 < o < num_tokens)})
    out = torch.empty(num_tokens, *v.shape[1:], dtype=v.dtype, device=v.device)
    for start, end in zip(edges, edges[1:], strict=False):
        m = end - start
        # Heads first: [H, m, dk], [H, m, dv], [H, m]
        qc, kc, vc = (t[start:end].transpose(0, 1) for t in (q, k, v))
        bc = beta[start:end].T
        cum = torch.cumsum(g[start:end].T, dim=-1)
        diff = cum[:, :, None] - cum[:, None, :]  # [H, t, s]: G_t - G_s
        ones = torch.ones(m, m, dtype=torch.bool, device=q.device)
        before = torch.exp(diff.masked_fill(~ones.tril(-1), float("-inf")))  # s < t
        upto = torch.exp(diff.masked_fill(~ones.tril(), float("-inf")))  # s <= t
        system = bc[:, :, None] * (kc @ kc.transpose(1, 2) * before)  # the I is implied
        rhs = torch.cat([bc[:, :, None] * vc, (bc * cum.exp())[:, :, None] * kc], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        w_v, w_k = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
        d = w_v - w_k @ state  # [H, m, dv]
        o = cum.exp()[:, :, None] * (qc @ state) + (qc @ kc.transpose(1, 2) * upto) @ d
        out[start:end] = o.transpose(0, 1)
        to_end = torch.exp(cum[:, -1:] - cum)  # [H, m]
        state = cum[:, -1].exp()[:, None, None] * state + \
            (kc * to_end[:, :, None]).transpose(1, 2) @ d
        if end in save_at:
            save_at[end].copy_(state.to(save_at[end].dtype))
    return out, state
