"""NemotronH: one mixer per layer (Mamba2, attention without RoPE, relu² MLP), pre-norm
residual blocks. The mix comes from `layer_mix` like every model's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.bamba import PartialRopeAttention
from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, MAMBA, layer_kinds
from hybridkv.models.layers import RMSNorm
from hybridkv.models.mamba2 import Mamba2Mixer
from hybridkv.worker.forward_context import ForwardContext


class ReluSquaredMLP(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        bias = bool(cfg.get("mlp_bias", False))
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int, kind: str | None) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(int(cfg["hidden_size"]), float(cfg.get("layer_norm_epsilon", 1e-5)))
        if kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(cfg, layer)
        elif kind == FULL:
            self.mixer = PartialRopeAttention(cfg, layer, use_rope=False)  # no positions
        elif kind is None:
            self.mixer = ReluSquaredMLP(cfg)
        else:
            raise NotImplementedError(f"NemotronH layer {layer}: {kind} mixers are not "
                                      f"supported yet")

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.norm(h)
        if self.kind == MAMBA:
            return h + self.mixer(x, ctx)
        if self.kind == FULL:
            return h + self.mixer(x, positions, ctx)
        return h + self.mixer(x)


class NemotronHModel(nn.Module):
    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        pattern = cfg.get("hybrid_override_pattern") or ""
        if "E" in pattern or "moe" in (cfg.get("layers_block_type") or []):
            raise NotImplementedError("NemotronH MoE layers are not supported yet")
        kinds = [parts[0] if parts else None for parts in layer_kinds(cfg)]
        self.embeddings = nn.Embedding(int(cfg["vocab_size"]), int(cfg["hidden_size"]))
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, k) for i, k in enumerate(kinds))
        self.norm_f = RMSNorm(int(cfg["hidden_size"]), float(cfg.get("layer_norm_epsilon", 1e-5)))


class NemotronHForCausalLM(CausalLM):
    model_type = "nemotron_h"
    embed_name = "embeddings"
    norm_name = "norm_f"

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config, NemotronHModel(config))
