"""The mLSTM layer of xLSTM: a matrix memory per head with exponential input and sigmoid
forget gates, kept stable by a running max exponent m. Per request its state lives in the
KV cache arena as two tensors (`inference_state_dtype`, float32 by default):

    C  [heads, qk_head, v_head]      the memory
    nm [heads, qk_head + 1]          the normaliser n, with m in the last column

Per token, with i, f the soft-capped gate pre-activations of each head:
    m' = max(log sigmoid(f) + m, i);   a = exp(log sigmoid(f) + m - m');   b = exp(i - m')
    C  = a C + b k v^T;   n = a n + b k
    h  = (q' C) / (max(|q' . n|, exp(-m')) + eps),   q' = q / sqrt(qk_head)
    out = out_proj(sigmoid(o) * LayerNorm_per_head(h))

A fresh state is all zeros, m included, as the reference starts it.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.state import Saves, request_states, state_places
from hybridkv.worker.forward_context import ForwardContext


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else cap * torch.tanh(x / cap)


def mlstm_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor,
               f: torch.Tensor, c: torch.Tensor, nm: torch.Tensor, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token: q, k [..., H, dk], v [..., H, dv], i, f [..., H]; c [..., H, dk, dv] and
    nm [..., H, dk + 1] (float32) -> (h [..., H, dv] float32, new c, new nm)."""
    n, m = nm[..., :-1], nm[..., -1:]
    log_f = nn.functional.logsigmoid(f)[..., None]  # [..., H, 1]
    m_new = torch.maximum(log_f + m, i[..., None])
    a, b = torch.exp(log_f + m - m_new), torch.exp(i[..., None] - m_new)
    c = a[..., None] * c + b[..., None] * (k[..., :, None] * v[..., None, :]).float()
    n = a * n + b * k.float()
    q = (q * q.shape[-1] ** -0.5).float()
    numerator = (q[..., None, :] @ c).squeeze(-2)  # [..., H, dv]
    qn = (q * n).sum(-1, keepdim=True)
    h = numerator / (torch.maximum(qn.abs(), torch.exp(-m_new)) + eps)
    return h, c, torch.cat([n, m_new], dim=-1)


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's values (float32, no bias), then one weight over all."""

    def __init__(self, num_heads: int, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads * dim))
        self.eps = eps

    def forward(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """h [T, H, dv] -> [T, H * dv] in `dtype`."""
        x = h.float()
        x = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True,
                                                              unbiased=False) + self.eps)
        return self.weight * x.to(dtype).flatten(1)  # type: ignore[no-any-return]


class MLstmLayer(nn.Module):
    """forward(x [T, hidden], positions [T], ctx) -> [T, hidden]."""

    def __init__(self, hidden: int, num_heads: int, qk_dim: int, v_dim: int, *, eps: float,
                 norm_eps: float, gate_soft_cap: float | None, layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"  # the state layer's name in the KV layout
        self.num_heads, self.eps, self.gate_soft_cap = num_heads, eps, gate_soft_cap
        self.q = nn.Linear(hidden, qk_dim, bias=False)
        self.k = nn.Linear(hidden, qk_dim, bias=False)
        self.v = nn.Linear(hidden, v_dim, bias=False)
        self.ogate_preact = nn.Linear(hidden, v_dim, bias=False)
        self.igate_preact = nn.Linear(hidden, num_heads, bias=True)
        self.fgate_preact = nn.Linear(hidden, num_heads, bias=True)
        self.multihead_norm = HeadLayerNorm(num_heads, v_dim // num_heads, norm_eps)
        self.out_proj = nn.Linear(v_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, states = ctx.state(self.name)
        heads = (self.num_heads, -1)
        q, k, v = (p(x).unflatten(-1, heads) for p in (self.q, self.k, self.v))
        i = soft_cap(self.igate_preact(x), self.gate_soft_cap).float()  # [T, H]
        f = soft_cap(self.fgate_preact(x), self.gate_soft_cap).float()
        h = torch.empty(v.shape, dtype=torch.float32, device=x.device)  # [T, H, dv]
        rows = meta.plain_steps  # single-token steps: all at once
        if rows:
            tokens = meta.plain_step_tokens(x.device)
            pages, slots = state_places(meta, rows, x.device)
            cs, nms = states
            h[tokens], c, nm = mlstm_step(q[tokens], k[tokens], v[tokens], i[tokens],
                                          f[tokens], cs[pages, slots].float(),
                                          nms[pages, slots].float(), self.eps)
            cs[pages, slots], nms[pages, slots] = c.to(cs.dtype), nm.to(nms.dtype)
        for start, end, c_state, nm_state, saves in request_states(meta, states, skip=rows):
            h[start:end] = self._scan(q[start:end], k[start:end], v[start:end],
                                      i[start:end], f[start:end], c_state, nm_state, saves)
        out = self.multihead_norm(h.to(x.dtype), x.dtype)
        return self.out_proj(torch.sigmoid(self.ogate_preact(x)) * out)  # type: ignore[no-any-return]

    def _scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor,
              f: torch.Tensor, c_state: torch.Tensor, nm_state: torch.Tensor,
              saves: Saves) -> torch.Tensor:
        """One request's tokens in order from its state (read and updated); checkpoints get
        the state after their offset. Returns h [L, H, dv] float32."""
        save_at = {offset: (c_saved, nm_saved) for offset, c_saved, nm_saved in saves}
        c, nm = c_state.float(), nm_state.float()
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for t in range(q.shape[0]):
            out[t], c, nm = mlstm_step(q[t], k[t], v[t], i[t], f[t], c, nm, self.eps)
            if t + 1 in save_at:
                save_at[t + 1][0].copy_(c)
                save_at[t + 1][1].copy_(nm)
        c_state.copy_(c)
        nm_state.copy_(nm)
        return out
