"""MiniMax-Text-01 / M1: lightning attention (a decayed linear attention, a fixed-size state
per request; layers/lightning_attention.py) on most layers, softmax attention with RoPE on
the others, a Mixtral-style MoE after each. Its residual differs from the usual pre-norm
one: the *normalised* input is the residual, and both branches are scaled,

    x = norm(h);  h = alpha * x + beta * mixer(x)     (alpha/beta per attention kind)
    x = norm(h);  h = alpha' * x + beta' * moe(x)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, LIGHTNING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.lightning_attention import LightningAttention
from hybridkv.models.layers.moe import ExpertMLPs, MoE, Routing
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext

# Checkpoints written by transformers also hold the lightning layers' decay buffers.
DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


class ScaledResidualLayer(nn.Module):
    def __init__(self, mixer: nn.Module, moe: MoE, hidden: int, eps: float,
                 mixer_scales: tuple[float, float], moe_scales: tuple[float, float]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.block_sparse_moe = moe
        self.mixer_scales, self.moe_scales = mixer_scales, moe_scales

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.input_layernorm(h)
        alpha, beta = self.mixer_scales
        h = x * alpha + self.self_attn(x, positions, ctx) * beta
        x = self.post_attention_layernorm(h)
        alpha, beta = self.moe_scales
        return x * alpha + self.block_sparse_moe(x) * beta  # type: ignore[no-any-return]


def minimax_layer(cfg: TextConfig, layer: int, kind: str | None) -> ScaledResidualLayer:
    raw, hidden = cfg.raw, cfg.hidden_size
    mixer: nn.Module
    if kind == LIGHTNING:
        mixer = LightningAttention(hidden, cfg.num_heads, cfg.head_dim, cfg.hidden_act,
                                   cfg.rms_norm_eps, layer, cfg.num_layers)
        prefix = "linear_attn"
    elif kind == FULL:
        mixer = Attention(layer, AttentionShape.from_config(cfg),
                          AttentionParams(scale=cfg.head_dim ** -0.5),
                          rotary=Rotary.from_config(raw, cfg.head_dim, FULL))
        prefix = "full_attn"
    else:
        raise NotImplementedError(f"minimax layer {layer}: {kind} layers are not supported")
    experts = ExpertMLPs(int(raw["num_local_experts"]), hidden, cfg.intermediate_size,
                         cfg.hidden_act)
    moe = MoE(hidden, experts, Routing(int(raw["num_experts_per_tok"]), "softmax",
                                       renormalize=True), router_name="gate")
    return ScaledResidualLayer(
        mixer, moe, hidden, cfg.rms_norm_eps,
        (float(raw.get(f"{prefix}_alpha_factor", 1)), float(raw.get(f"{prefix}_beta_factor", 1))),
        (float(raw.get("mlp_alpha_factor", 1)), float(raw.get("mlp_beta_factor", 1))))


class MiniMaxForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-5)
        if cfg.sliding_window:
            raise NotImplementedError("minimax: sliding_window on the softmax attention layers "
                                      "is not supported")
        super().__init__(cfg, (minimax_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renames = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.rsplit(".", 1)[-1] in DECAY_BUFFERS:
                    continue  # computed from the config here
                for old, new in renames:
                    name = name.replace(old, new)
                yield name, tensor
        super().load_weights(renamed())
