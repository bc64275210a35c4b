"""Ling 3.0 (Bailing hybrid): Kimi Delta Attention (layers/kda.py) on most layers,
multi-head latent attention with RoPE on the last of every `layer_group_size` layers
(layers/mla.py: DeepSeek's interleaved RoPE on the shared key part, a sigmoid gate per
head), dense MLPs on the first `first_k_dense_replace` layers and DeepSeek-V3-style routed +
shared experts on the rest (layers/routed_moe.py).

KDA's decay is full rank with a bounded ("safe") gate: lower_bound * sigmoid(exp(A_log) *
(f_proj(h) + dt_bias)) per channel, or -exp(A_log) * softplus(...) without it; its output gate
is g_proj(h). Checkpoints name the mixer `attention`, its output projection `dense`, the
embedding `word_embeddings` and the router bias `expert_bias`; multi-token-prediction layers
after the last layer are not run."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, KDA, kda_shape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.kda import KimiDeltaAttention, fuse_qkv_conv
from hybridkv.models.layers.mla import LatentAttention
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.rotary import Rotary, rope_params
from hybridkv.models.layers.routed_moe import is_sparse, routed_moe
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed

NAMES = ((r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias"),)


class LingKDA(KimiDeltaAttention):
    def __init__(self, cfg: TextConfig, layer: int) -> None:
        heads, head_dim, kernel = kda_shape(cfg.raw)
        super().__init__(layer, cfg.hidden_size, heads, head_dim, kernel, cfg.rms_norm_eps,
                         cfg.hidden_act)
        width = heads * head_dim
        self.f_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.g_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.dense = nn.Linear(width, cfg.hidden_size, bias=False)
        self.safe_gate = bool(cfg.raw.get("kda_safe_gate", True))
        self.lower_bound = float(cfg.raw.get("kda_lower_bound", -5.0))

    def decay(self, h: torch.Tensor) -> torch.Tensor:
        x = (self.f_proj(h).float() + self.dt_bias.float()).unflatten(
            -1, (self.num_heads, self.head_dim))
        rate = self.A_log.float().exp()[:, None]  # [heads, 1]
        gate = self.lower_bound * torch.sigmoid(rate * x) if self.safe_gate \
            else -rate * nn.functional.softplus(x)
        return gate.to(h.dtype)  # the reference rounds the decay to the model's dtype

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        return self.g_proj(h).unflatten(-1, (self.num_heads, self.head_dim))  # type: ignore[no-any-return]

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.dense(o)  # type: ignore[no-any-return]


def mla_scale(raw: Mapping[str, Any]) -> float:
    """1/sqrt(q head size), times YaRN's mscale(factor, mscale_all_dim)^2 when set."""
    scale = (int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])) ** -0.5
    params = rope_params(raw, FULL)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = float(params["factor"])
        if factor > 1:
            m = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= m * m
    return scale


def ling_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    raw = cfg.raw
    mixer: nn.Module
    if kind == KDA:
        mixer = LingKDA(cfg, layer)
    else:
        rotary = Rotary(int(raw["qk_rope_head_dim"]), rope_params(raw, FULL))
        mixer = LatentAttention(raw, layer, scale=mla_scale(raw), rotary=rotary,
                                output_gate=True, out_name="dense")
    mlp: nn.Module = routed_moe(raw, cfg.hidden_size, cfg.hidden_act) if is_sparse(
        raw, layer, first_dense=2) else GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                                 cfg.hidden_act)
    return DecoderLayer(LayerNames("attention"), mixer, [mlp], cfg.hidden_size,
                        cfg.rms_norm_eps)


class BailingHybridForCausalLM(CausalLM):
    embed_name = "word_embeddings"

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        if cfg.raw.get("q_lora_rank"):
            raise NotImplementedError("bailing_hybrid: q_lora_rank is not supported (Ling "
                                      "projects queries directly); accepted: null")
        super().__init__(cfg, (ling_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))
        # Multi-token-prediction layers follow the last decoder layer in the checkpoint.
        num_mtp = int(cfg.raw.get("num_nextn_predict_layers") or 0)
        self.unused_weights += tuple(f"model.layers.{cfg.num_layers + i}."
                                     for i in range(num_mtp))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(fuse_qkv_conv(renamed(weights, NAMES)))
