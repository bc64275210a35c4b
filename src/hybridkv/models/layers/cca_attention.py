"""Zaya's compressed convolutional attention (CCA): attention whose queries and keys come
through a causal convolution and whose values are half delayed by one token, so each layer
keeps a small state beside its KV cache (the `cca` state kind of layer_mix):

    q0, k0 = q_proj(h), k_proj(h)                       # [T, Hq*D], [T, Hk*D]
    r_q = (q0 + k0 repeated per query group) / 2; r_k = r_q averaged over each group
    [cq | ck] = grouped_conv(depthwise_conv([q0 | k0]))  # causal, kernels cca_time0/1
    q, k = cq + r_q, ck + r_k
    v = [v_proj_current(h_t) | v_proj_delayed(h_{t-1})]  # viewed as Hk heads of D
    q, k = sqrt(D) q / |q|, sqrt(D) k / |k| x temp[kv head];  RoPE (part of each head)
    out = o_proj(attention(q, k, v))

State per request: the convs' last (cca_time0 - 1) + (cca_time1 - 1) inputs [C, kernel]
and v_proj_delayed's output at the last token [Hk*D / 2]; a fresh request starts from zero
inputs and v_proj_delayed(0). Checkpoints at block boundaries are both of them there."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.rotary import Rotary
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class CCAProjection(nn.Module):
    """h [T, hidden] -> (q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) through the layer's state."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 kernels: tuple[int, int], bias: bool, state_name: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.state_name = state_name
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.v_proj_current = nn.Linear(hidden, kv_width // 2, bias=bias)
        self.v_proj_delayed = nn.Linear(hidden, kv_width // 2, bias=bias)
        channels = q_width + kv_width
        self.conv_qk_depthwise = nn.Conv1d(channels, channels, kernels[0], groups=channels)
        self.conv_qk_grouped = nn.Conv1d(channels, channels, kernels[1],
                                         groups=num_heads + num_kv_heads)
        self.keep = kernels[0] + kernels[1] - 2

    def forward(self, h: torch.Tensor, ctx: ForwardContext
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, hq, hk, d = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q0, k0 = self.q_proj(h), self.k_proj(h)
        r_q = (q0.view(t, hq, d) + k0.view(t, hk, d).repeat_interleave(hq // hk, dim=1)) * 0.5
        r_k = r_q.view(t, hk, hq // hk, d).mean(dim=-2)
        qk_in = torch.cat([q0, k0], dim=-1)  # [T, C]
        current, delayed = self.v_proj_current(h), self.v_proj_delayed(h)
        qk = torch.empty_like(qk_in)
        v_delayed = torch.empty_like(delayed)
        meta, (conv_states, v_states) = ctx.state(self.state_name)
        for r in range(len(meta.state_pages)):
            start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            if start == end:
                continue
            page, slot = meta.state_pages[r], meta.state_slots[r]
            conv_state, v_state = conv_states[page, slot], v_states[page, slot]
            if meta.init_from[r] is not None:
                conv_state.copy_(conv_states[meta.init_from[r]])
                v_state.copy_(v_states[meta.init_from[r]])
            elif not meta.has_initial_state[r]:
                conv_state.zero_()
                v_state.copy_(self.v_proj_delayed(h.new_zeros(h.shape[1])))
            window = torch.cat([conv_state.to(h.dtype), qk_in[start:end].T], dim=-1)
            # [keep + L, kv / 2]: the delayed values of the previous token, then these.
            values = torch.cat([v_state.to(h.dtype)[None], delayed[start:end]])
            for offset, p, s in meta.checkpoints[r]:  # the state `offset` tokens in
                conv_states[p, s].copy_(window[:, offset:offset + self.keep])
                v_states[p, s].copy_(values[offset])
            conv_state.copy_(window[:, -self.keep:])
            v_state.copy_(values[-1])
            conv = self.conv_qk_grouped(self.conv_qk_depthwise(window[None]))[0]  # [C, L]
            qk[start:end] = conv.T
            v_delayed[start:end] = values[:-1]
        q = qk[:, :hq * d].view(t, hq, d) + r_q
        k = qk[:, hq * d:].view(t, hk, d) + r_k
        v = torch.cat([current, v_delayed], dim=-1).view(t, hk, d)
        return q, k, v


class KeyTemperature(nn.Module):
    """The learned scale of each KV head's unit keys (checkpoints: `qk_norm.temp`)."""

    def __init__(self, num_kv_heads: int) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.zeros(num_kv_heads))


class CCAAttention(nn.Module):
    """forward(h [T, hidden], positions [T], ctx) -> [T, hidden]."""

    def __init__(self, layer: int, hidden: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, params: AttentionParams, *, rotary: Rotary,
                 kernels: tuple[int, int], bias: bool) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.self_attn"
        self.params, self.rotary, self.head_dim = params, rotary, head_dim
        self.qkv_proj = CCAProjection(hidden, num_heads, num_kv_heads, head_dim,
                                      kernels=kernels, bias=bias,
                                      state_name=f"model.layers.{layer}.mamba")
        self.qk_norm = KeyTemperature(num_kv_heads)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=bias)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(h, ctx)
        eps = torch.finfo(q.dtype).eps
        scale = self.head_dim ** 0.5
        q = q * (scale / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (scale / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * self.qk_norm.temp[None, :, None]
        cos, sin = self.rotary.cos_sin(positions, ctx)
        q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        out = ctx.attention(self.name, q, k, v, self.params)
        return self.o_proj(out.flatten(1))  # type: ignore[no-any-return]
