"""GraniteMoeHybrid (Granite 4.0-H): Mamba2 and attention layers (NoPE unless
`position_embedding_type` is "rope"), each followed by a top-k MoE plus a shared SwiGLU MLP,
with the µP multipliers on embeddings, attention, residuals and logits. Tensors follow the
checkpoint layout (`block_sparse_moe.input_linear` [E, 2I, H], gate rows then up rows)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, MAMBA
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mamba2 import Mamba2Mixer
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import Routing, act_glu, dispatch, glu_project, route
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams


class Linear3D(nn.Module):
    """Stacked expert weights, stored as the checkpoint stores them."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, out_features, in_features))


class BlockSparseMoE(nn.Module):
    """Softmax over each token's top-k router logits (`router.layer`)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        num_experts = int(cfg.raw["num_local_experts"])
        self.router = nn.Module()
        self.router.layer = nn.Linear(hidden, num_experts, bias=False)
        self.input_linear = Linear3D(num_experts, 2 * inter, hidden)
        self.output_linear = Linear3D(num_experts, hidden, inter)
        self.routing = Routing(int(cfg.raw["num_experts_per_tok"]), "softmax_topk")
        self.glu = act_glu(cfg.hidden_act)

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = glu_project(x, self.input_linear.weight[expert], False).chunk(2, dim=-1)
        return glu_project(self.glu(gate, up), self.output_linear.weight[expert], False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router.layer(x), self.routing, x.dtype)
        return dispatch(x, weights, ids, self.run_expert)


def granite_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    raw = cfg.raw
    mixer: nn.Module
    if kind == MAMBA:
        name, mixer = "mamba", Mamba2Mixer(raw, layer)
    else:
        rope = raw.get("position_embedding_type") == "rope"
        name, mixer = "self_attn", Attention(
            layer, AttentionShape.from_config(cfg),
            AttentionParams(scale=float(raw.get("attention_multiplier", 1.0))),
            rotary=Rotary.from_config(raw, cfg.head_dim, FULL) if rope else None)
    ffns: list[nn.Module] = [GatedMLP(cfg.hidden_size, int(raw["shared_intermediate_size"]),
                                      cfg.hidden_act, fused=("input_linear", "output_linear"))]
    ffn_names: tuple[str, ...] = ("shared_mlp",)
    if int(raw.get("num_local_experts") or 0) > 0:
        ffns.insert(0, BlockSparseMoE(cfg))
        ffn_names = ("block_sparse_moe", "shared_mlp")
    return DecoderLayer(LayerNames(name, ffns=ffn_names), mixer, ffns, cfg.hidden_size,
                        cfg.rms_norm_eps,
                        residual_multiplier=float(raw.get("residual_multiplier", 1.0)))


class GraniteMoeHybridForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        super().__init__(cfg, (granite_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))
