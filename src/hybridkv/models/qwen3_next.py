"""Qwen3-Next: Gated DeltaNet linear attention (a fixed-size state per request) on three of
every four layers, gated full attention on the fourth, a top-k MoE with a sigmoid-gated
shared expert after each. Norms are zero-centred: `x * (1 + w)`.

Gated delta rule, per value head, with q and k L2-normalised (q also by 1/sqrt(d_k)):
    S <- S * exp(g_t);   S <- S + k_t (outer) ((v_t - S^T k_t) * beta_t);   o_t = S^T q_t
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.bamba import PartialRopeAttention, SwiGLU
from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import LINEAR, layer_kinds
from hybridkv.models.layers import RMSNorm, activation, apply_rope
from hybridkv.models.mamba2 import Saves, causal_conv, request_states
from hybridkv.worker.forward_context import ForwardContext


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        meta, states = ctx.state(self.name)
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(h), self.in_proj_ba(h))
        mixed = torch.cat([q, k, v], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias)
        out = torch.empty(h.shape[0], self.num_v_heads, self.v_dim, device=h.device)
        for start, end, conv_state, state, saves in request_states(meta, states):
            out[start:end] = self._request(mixed[start:end], beta[start:end], g[start:end],
                                           conv_state, state, saves)
        # Gated norm per value head: normalise, weight, then gate with silu(z).
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        gated = (self.norm.weight * normed.to(h.dtype)).float() * nn.functional.silu(z.float())
        return self.out_proj(gated.to(h.dtype).flatten(1))

    def _request(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                 conv_state: torch.Tensor, state: torch.Tensor,
                 saves: Saves) -> torch.Tensor:
        x = self.act(causal_conv(mixed, conv_state, self.conv1d, saves))
        q, k, v = x.float().split([self.key_size, self.key_size, self.value_size], dim=-1)
        per = self.num_v_heads // self.num_k_heads
        q = l2norm(q.unflatten(-1, (self.num_k_heads, self.k_dim))).repeat_interleave(per, 1)
        k = l2norm(k.unflatten(-1, (self.num_k_heads, self.k_dim))).repeat_interleave(per, 1)
        q = q / self.k_dim ** 0.5
        v = v.unflatten(-1, (self.num_v_heads, self.v_dim))
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


class GatedAttention(PartialRopeAttention):
    """q_proj yields queries and a sigmoid output gate per head; q/k normalised per head."""

    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__(cfg, layer, gated=True)
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps, 1.0)
        self.k_norm = RMSNorm(self.head_dim, eps, 1.0)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q, gate = self.q_proj(h).unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, -1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = ctx.rope_cos_sin(positions, self.rope_key, self.inv_freq, self.rope_scaling)
        d = self.rotary_dim
        q = torch.cat([apply_rope(q[..., :d], cos, sin), q[..., d:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :d], cos, sin), k[..., d:]], dim=-1)
        out = ctx.attention(self.name, q, k, v, self.params).flatten(1)
        return self.o_proj(out * torch.sigmoid(gate.flatten(1)))


class ExpertMLP(SwiGLU):
    def __init__(self, cfg: Mapping[str, Any], intermediate: int) -> None:
        super().__init__({**cfg, "intermediate_size": intermediate})


class SparseMoE(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, num_experts = int(cfg["hidden_size"]), int(cfg["num_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        self.norm_topk = bool(cfg.get("norm_topk_prob", True))
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(cfg, int(cfg["moe_intermediate_size"]))
                                     for _ in range(num_experts))
        self.shared_expert = ExpertMLP(cfg, int(cfg["shared_expert_intermediate_size"]))
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        top = top.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in top_ids.unique().tolist():
            token_idx, slot = torch.where(top_ids == expert)
            out.index_add_(0, token_idx,
                           self.experts[expert](x[token_idx]) * top[token_idx, slot, None])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, kind: str) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = GatedAttention(cfg, layer)
        sparse = int(cfg.get("num_experts") or 0) > 0 and \
            layer not in (cfg.get("mlp_only_layers") or []) and \
            (layer + 1) % int(cfg.get("decoder_sparse_step", 1)) == 0
        self.mlp: nn.Module = SparseMoE(cfg) if sparse else SwiGLU(cfg)
        self.input_layernorm = RMSNorm(hidden, eps, 1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, 1.0)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.kind == LINEAR:
            h = h + self.linear_attn(x, ctx)
        else:
            h = h + self.self_attn(x, positions, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        kinds = [parts[0] for parts in layer_kinds(cfg)]
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), hidden)
        self.layers = nn.ModuleList(Qwen3NextLayer(cfg, i, k) for i, k in enumerate(kinds))
        self.norm = RMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-6)), 1.0)


class Qwen3NextForCausalLM(CausalLM):
    model_type = "qwen3_next"

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config, Qwen3NextModel(config))
