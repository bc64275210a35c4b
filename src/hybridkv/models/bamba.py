"""Bamba: Mamba2 layers with attention layers (RoPE on part of each head) at
`attn_layer_indices`, a SwiGLU MLP after every mixer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, MAMBA, layer_kinds
from hybridkv.models.layers import RMSNorm, activation, apply_rope, rope_inv_freq, rope_key
from hybridkv.models.mamba2 import Mamba2Mixer
from hybridkv.worker.attention import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class PartialRopeAttention(nn.Module):
    """Rotates the first `partial_rotary_factor` of each head, passes the rest through
    (`use_rope=False`: no positions at all, as in Granite 4.0-H)."""

    def __init__(self, cfg: Mapping[str, Any], layer: int, *, use_rope: bool = True,
                 scale: float | None = None, key_multiplier: float = 1.0,
                 gated: bool = False) -> None:
        super().__init__()
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        self.head_dim = int(cfg.get("head_dim") or hidden // heads)
        self.num_heads, self.num_kv_heads = heads, int(cfg["num_key_value_heads"])
        self.name = f"model.layers.{layer}.self_attn"
        bias = bool(cfg.get("attention_bias", False))
        # `gated` (Qwen3-Next): q_proj also yields an output gate per head.
        self.q_proj = nn.Linear(hidden, (2 if gated else 1) * heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        params = dict(cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta",
                                                                           10000.0)})
        factor = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor",
                                                                   1.0)))
        self.rotary_dim = int(self.head_dim * factor)
        inv_freq, self.rope_scaling = rope_inv_freq(self.rotary_dim, params)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_key = rope_key(self.rotary_dim, params)
        self.use_rope = use_rope
        self.key_multiplier = key_multiplier  # Falcon-H1's µP factor on keys
        self.params = AttentionParams(scale=scale if scale is not None else self.head_dim ** -0.5)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q = self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        v = self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.use_rope:
            cos, sin = ctx.rope_cos_sin(positions, self.rope_key, self.inv_freq,
                                        self.rope_scaling)
            d = self.rotary_dim
            q = torch.cat([apply_rope(q[..., :d], cos, sin), q[..., d:]], dim=-1)
            k = torch.cat([apply_rope(k[..., :d], cos, sin), k[..., d:]], dim=-1)
        return self.o_proj(ctx.attention(self.name, q, k, v, self.params).flatten(1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = activation(str(cfg.get("hidden_act", "silu")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class BambaLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, kind: str) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5))
        self.kind = kind
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(cfg, layer)
        elif kind == FULL:
            self.self_attn = PartialRopeAttention(cfg, layer)
        else:
            raise NotImplementedError(f"Bamba layer {layer}: {kind} layers are not supported")
        self.feed_forward = SwiGLU(cfg)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        mixed = self.mamba(x, ctx) if self.kind == MAMBA else self.self_attn(x, positions, ctx)
        h = h + mixed
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class BambaModel(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        kinds = [parts[0] for parts in layer_kinds(cfg)]
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), hidden)
        self.layers = nn.ModuleList(BambaLayer(cfg, i, k) for i, k in enumerate(kinds))
        self.final_layernorm = RMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-5)))


class BambaForCausalLM(CausalLM):
    model_type = "bamba"
    norm_name = "final_layernorm"

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config, BambaModel(config))
