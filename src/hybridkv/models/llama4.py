"""Llama 4 text: chunked local attention on RoPE layers, global attention on NoPE layers, MoE.

What sets it apart from the Llama family: RoPE rotates adjacent pairs (complex form), RoPE
layers attend within chunks of `attention_chunk_size` and L2-normalise q/k after RoPE, NoPE
layers attend globally and scale queries with position ("temperature tuning"), and MoE layers
scale each expert's *input* by a sigmoid router score and add a shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import CHUNKED, layer_kinds
from hybridkv.models.layers import GatedMLP, RMSNorm, activation, rope_inv_freq
from hybridkv.worker.attention import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


def apply_rope_pairs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
                     ) -> torch.Tensor:
    """x [T, H, D] rotated as complex pairs (x[2i], x[2i+1])."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(x.device)  # [T, D/2]
    rot = torch.polar(torch.ones_like(freqs), freqs).unsqueeze(1)  # [T, 1, D/2]
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, chunked: bool) -> None:
        super().__init__()
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        self.head_dim = int(cfg.get("head_dim") or hidden // heads)
        self.num_heads, self.num_kv_heads = heads, int(cfg["num_key_value_heads"])
        self.name = f"model.layers.{layer}.self_attn"
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        flags = cfg.get("no_rope_layers")
        self.use_rope = bool(flags[layer]) if flags else chunked  # 1 = uses RoPE
        self.qk_norm = bool(cfg.get("use_qk_norm", True)) and self.use_rope
        self.eps = float(cfg.get("rms_norm_eps", 1e-5))
        self.temperature_tuning = bool(cfg.get("attn_temperature_tuning", True)) and \
            not self.use_rope
        self.floor_scale = float(cfg.get("floor_scale", 8192))
        self.attn_scale = float(cfg.get("attn_scale", 0.1))
        params = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}),
                                                "rope_theta": cfg.get("rope_theta", 500000.0)}
        inv_freq, _ = rope_inv_freq(self.head_dim, params)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.params = AttentionParams(
            scale=self.head_dim ** -0.5,
            chunk_size=int(cfg["attention_chunk_size"]) if chunked else None)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q = self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.use_rope:
            q = apply_rope_pairs(q, positions, self.inv_freq)
            k = apply_rope_pairs(k, positions, self.inv_freq)
        if self.qk_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature_tuning:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
            q = (q * (scales * self.attn_scale + 1.0).view(-1, 1, 1)).to(q.dtype)
        return self.o_proj(ctx.attention(self.name, q, k, v, self.params).flatten(1))


class Llama4Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, intermediate, hidden))


class Llama4MoE(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.top_k = int(cfg.get("num_experts_per_tok", 1))
        num_experts = int(cfg["num_local_experts"])
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Llama4Experts(num_experts, hidden, inter)
        self.shared_expert = GatedMLP(hidden, inter, str(cfg.get("hidden_act", "silu")))
        self.act = activation(str(cfg.get("hidden_act", "silu")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden]; the router's sigmoid score scales the expert's input.
        logits = self.router(x)
        top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)
        out = self.shared_expert(x)
        ex = self.experts
        for expert in top_ids.unique().tolist():
            token_idx, slot = torch.where(top_ids == expert)
            score = torch.sigmoid(top_logits[token_idx, slot].float()).to(x.dtype)
            gate, up = (x[token_idx] * score[:, None] @ ex.gate_up_proj[expert]).chunk(2, -1)
            out.index_add_(0, token_idx, (up * self.act(gate)) @ ex.down_proj[expert])
        return out


class Llama4DecoderLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, chunked: bool, moe: bool) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5))
        self.self_attn = Llama4Attention(cfg, layer, chunked)
        self.feed_forward: nn.Module = Llama4MoE(cfg) if moe else GatedMLP(
            hidden, int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
            str(cfg.get("hidden_act", "silu")))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx)
        return h + self.feed_forward(self.post_attention_layernorm(h))


class Llama4Model(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        n = int(cfg["num_hidden_layers"])
        kinds = [parts[0] for parts in layer_kinds(cfg)]
        step = int(cfg.get("interleave_moe_layer_step", 1))
        moe_layers = cfg.get("moe_layers")
        if moe_layers is None:
            moe_layers = [i for i in range(n) if (i + 1) % step == 0] if step else []
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), int(cfg["hidden_size"]))
        self.layers = nn.ModuleList(
            Llama4DecoderLayer(cfg, i, kinds[i] == CHUNKED, i in set(moe_layers))
            for i in range(n))
        self.norm = RMSNorm(int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5)))


class Llama4ForCausalLM(CausalLM):
    model_type = "llama4_text"

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = config.get("text_config") or config
        super().__init__(cfg, Llama4Model(cfg))
