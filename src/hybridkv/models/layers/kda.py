"""Kimi Delta Attention (KDA): the gated delta rule with a decay per key channel instead of
one per head (Kimi Linear, Ling 3.0 / Bailing hybrid), its state per request in the KV cache
arena: the conv's last inputs and a float32 `[heads, head_dim (k), head_dim (v)]` matrix.

    q, k, v = act(causal conv(q_proj(h) | k_proj(h) | v_proj(h)))     per head (act: silu)
    q, k L2-normalised (q also by 1/sqrt(d));  beta = sigmoid(b_proj(h));  g = decay(h) <= 0
    S <- diag(exp(g_t)) S;   S <- S + k_t ((v_t - S^T k_t) beta_t)^T;   o_t = S^T q_t
    out = o_proj(rms_norm(o) * o_norm.weight * sigmoid(output_gate(h)))

Families differ only in how the decay and the output gate come from h (`decay`, `gate`).
Prompt chunks run the rule in chunked form (`chunked_kda_rule`); single-token steps of all
requests go in one batched update.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.models.layers.gated_deltanet import HeadNormWeight
from hybridkv.models.layers.state import (
    causal_conv,
    conv_step,
    request_states,
    state_places,
)
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.state import StateMetadata


class KimiDeltaAttention(nn.Module):
    """forward(h [T, hidden], positions [T], ctx) -> [T, hidden]. Subclasses define
    `decay(h) -> [T, heads, head_dim]` (float32, <= 0) and `gate(h) -> [T, heads, head_dim]`."""

    def __init__(self, layer: int, hidden: int, num_heads: int, head_dim: int, kernel: int,
                 eps: float, act: str) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"  # the state layer's name in the KV layout
        self.native_ops = False  # the causal conv in C (state.causal_conv)
        self.num_heads, self.head_dim, self.eps = num_heads, head_dim, eps
        width = num_heads * head_dim
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        # One depthwise conv over [q | k | v]; checkpoints keep three (see fuse_qkv_conv).
        self.conv1d = nn.Conv1d(3 * width, 3 * width, kernel, groups=3 * width, bias=False)
        self.b_proj = nn.Linear(hidden, num_heads, bias=False)
        self.o_norm = HeadNormWeight(head_dim)
        self.act = activation(act)

    def decay(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, states = ctx.state(self.name)
        mixed = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        beta = torch.sigmoid(self.b_proj(h)).float()  # [T, heads]
        g = self.decay(h).float()  # [T, heads, head_dim]
        out = torch.empty(h.shape[0], self.num_heads, self.head_dim, device=h.device)
        batched = meta.plain_steps  # single-token steps: all at once
        if batched:
            tokens = meta.plain_step_tokens(h.device)
            out[tokens] = self._decode_batch(mixed[tokens], beta[tokens], g[tokens], meta,
                                             batched, states)
        for start, end, conv_state, state, saves in request_states(meta, states,
                                                                   skip=batched):
            x = self.act(causal_conv(mixed[start:end], conv_state, self.conv1d, saves,
                                     native=self.native_ops))
            save_at = {offset: ssm for offset, _, ssm in saves}
            out[start:end], s = chunked_kda_rule(*self._qkv(x), beta[start:end],
                                                 g[start:end], state.float(), save_at)
            state.copy_(s.to(state.dtype))
        # Gated norm per head, in float32: normalise, weight, then gate with sigmoid(gate).
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        gated = normed * self.o_norm.weight.float() * torch.sigmoid(self.gate(h).float())
        return self.project_out(gated.to(h.dtype).flatten(1))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [L, 3 * width] after the conv -> q, k, v [L, heads, head_dim], float32; q and k
        L2-normalised, q also by 1/sqrt(head_dim)."""
        q, k, v = x.float().unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q / self.head_dim ** 0.5, k, v

    def _decode_batch(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                      meta: StateMetadata, rows: list[int],
                      states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One token for each of `rows`: mixed [R, 3 * width], beta [R, heads], g [R, heads,
        head_dim] -> [R, heads, head_dim]."""
        conv_states, ssm_states = states
        pages, slots = state_places(meta, rows, mixed.device)
        q, k, v = self._qkv(self.act(conv_step(mixed, conv_states, pages, slots,
                                               self.conv1d)))
        s = ssm_states[pages, slots].float() * g.exp()[..., None]  # [R, heads, dk, dv]
        memory = (s * k[..., None]).sum(dim=2)  # [R, heads, dv]
        delta = (v - memory) * beta[..., None]
        s = s + k[..., None] * delta[:, :, None, :]
        ssm_states[pages, slots] = s.to(ssm_states.dtype)
        return (s * q[..., None]).sum(dim=2)


def chunked_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     g: torch.Tensor, state: torch.Tensor, save_at: dict[int, torch.Tensor],
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule with per-channel decay a chunk at a time: q/k [L, H, dk], v [L, H, dv],
    beta [L, H], g [L, H, dk], state [H, dk, dv] (float32). Returns (o [L, H, dv], the final
    state); writes the state after `offset` tokens into `save_at[offset]` (chunks end there).

    Per token S_t = D_t S_{t-1} + k_t d_t^T with D_t = diag(exp(g_t)) and d_t = beta_t (v_t -
    (D_t S_{t-1})^T k_t). Within a chunk starting from S_0, with G_t = g_1 + ... + g_t
    (per channel, all <= 0) and E_ts = exp(G_t - G_s) (per channel, s <= t):
        S_t = diag(exp(G_t)) S_0 + sum_{s<=t} diag(E_ts) k_s d_s^T
    so the d_t solve one unit lower-triangular system,
        (I + diag(beta) A) d = diag(beta) (v - (K * exp(G)) S_0),
        A[t, s] = sum_c k_t[c] E_ts[c] k_s[c] for s < t,
    and o_t = (q_t * exp(G_t))^T S_0 + sum_{s<=t} (sum_c q_t[c] E_ts[c] k_s[c]) d_s.
    E is formed per pair (not as exp(G_t) exp(-G_s), which overflows on long chunks)."""
    num_tokens = q.shape[0]
    edges = sorted({0, num_tokens, *range(chunk_size, num_tokens, chunk_size),
                    *(o for o in save_at if 0 < o < num_tokens)})
    out = torch.empty(num_tokens, *v.shape[1:], dtype=v.dtype, device=v.device)
    for start, end in zip(edges, edges[1:], strict=False):
        m = end - start
        # Heads first: [H, m, dk], [H, m, dv], [H, m]
        qc, kc, vc, gc = (t[start:end].transpose(0, 1) for t in (q, k, v, g))
        bc = beta[start:end].T
        cum = torch.cumsum(gc, dim=1)  # [H, m, dk]
        ones = torch.ones(m, m, dtype=torch.bool, device=q.device)
        diff = cum[:, :, None, :] - cum[:, None, :, :]  # [H, t, s, dk]: G_t - G_s
        upto = torch.exp(diff.masked_fill(~ones.tril()[..., None], float("-inf")))
        pair_k = torch.einsum("htc,htsc,hsc->hts", kc, upto, kc)
        pair_q = torch.einsum("htc,htsc,hsc->hts", qc, upto, kc)
        system = bc[:, :, None] * pair_k.tril(-1)  # the I is implied
        rhs = torch.cat([bc[:, :, None] * vc, bc[:, :, None] * kc * cum.exp()], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        w_v, w_k = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
        d = w_v - w_k @ state  # [H, m, dv]
        o = (qc * cum.exp()) @ state + pair_q @ d
        out[start:end] = o.transpose(0, 1)
        to_end = torch.exp(cum[:, -1:] - cum)  # [H, m, dk]
        state = cum[:, -1].exp()[:, :, None] * state + (kc * to_end).transpose(1, 2) @ d
        if end in save_at:
            save_at[end].copy_(state.to(save_at[end].dtype))
    return out, state


def fuse_qkv_conv(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoints keep KDA's conv as `q_conv1d`, `k_conv1d`, `v_conv1d` ([width, 1, kernel]
    each); the layer runs one `conv1d` over [q | k | v]: the three are joined in that order
    (each yielded once all three of its layer have been seen)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        stem, _, leaf = name.rpartition(".")
        prefix, _, conv = stem.rpartition(".")
        if leaf != "weight" or conv not in ("q_conv1d", "k_conv1d", "v_conv1d"):
            yield name, tensor
            continue
        seen = parts.setdefault(prefix, {})
        seen[conv[0]] = tensor
        if len(seen) == 3:
            yield f"{prefix}.conv1d.weight", torch.cat([seen[c] for c in "qkv"])
            del parts[prefix]
    if parts:
        raise ValueError(f"checkpoint has an incomplete q/k/v conv at {sorted(parts)[0]!r}")
