"""GraniteMoeHybrid (Granite 4.0-H): Mamba2 and attention layers (NoPE unless
`position_embedding_type` is "rope"), each followed by a top-k MoE plus a shared SwiGLU MLP,
with the µP multipliers on embeddings, attention, residuals and logits. Tensors follow the
checkpoint layout (`block_sparse_moe.input_linear` [E, 2I, H], gate rows then up rows)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.bamba import PartialRopeAttention
from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import MAMBA, layer_kinds
from hybridkv.models.layers import RMSNorm, activation
from hybridkv.models.mamba2 import Mamba2Mixer
from hybridkv.worker.forward_context import ForwardContext


class SharedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * inter, bias=False)
        self.output_linear = nn.Linear(inter, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class Linear3D(nn.Module):
    """Stacked expert weights, stored as the checkpoint stores them."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, out_features, in_features))


class BlockSparseMoE(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        num_experts = int(cfg["num_local_experts"])
        self.top_k = int(cfg["num_experts_per_tok"])
        self.router = Router(hidden, num_experts)
        self.input_linear = Linear3D(num_experts, 2 * inter, hidden)
        self.output_linear = Linear3D(num_experts, hidden, inter)
        self.act = activation(str(cfg.get("hidden_act", "silu")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, hidden]: softmax over each token's top-k router logits.
        logits = self.router.layer(x).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for expert in top_ids.unique().tolist():
            token_idx, slot = torch.where(top_ids == expert)
            gate, up = nn.functional.linear(
                x[token_idx], self.input_linear.weight[expert]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act(gate) * up, self.output_linear.weight[expert])
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
        return out


class GraniteHybridLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, kind: str) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
        self.kind = kind
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(cfg, layer)
        else:
            self.self_attn = PartialRopeAttention(
                cfg, layer, use_rope=cfg.get("position_embedding_type") == "rope",
                scale=float(cfg.get("attention_multiplier", 1.0)))
        self.has_experts = int(cfg.get("num_local_experts") or 0) > 0
        if self.has_experts:
            self.block_sparse_moe = BlockSparseMoE(cfg)
        self.shared_mlp = SharedMLP(hidden, int(cfg["shared_intermediate_size"]),
                                    str(cfg.get("hidden_act", "silu")))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        x = self.mamba(x, ctx) if self.kind == MAMBA else self.self_attn(x, positions, ctx)
        h = h + x * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        y = self.shared_mlp(x)
        if self.has_experts:
            y = self.block_sparse_moe(x) + y
        return h + y * self.residual_multiplier


class GraniteHybridModel(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        kinds = [parts[0] for parts in layer_kinds(cfg)]
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), hidden)
        self.layers = nn.ModuleList(GraniteHybridLayer(cfg, i, k) for i, k in enumerate(kinds))
        self.norm = RMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-6)))


class GraniteMoeHybridForCausalLM(CausalLM):
    model_type = "granitemoehybrid"

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config, GraniteHybridModel(config))
