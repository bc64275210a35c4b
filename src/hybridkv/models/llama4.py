"""Llama 4 text: chunked local attention on RoPE layers, global attention on NoPE layers, MoE.

What sets it apart from the Llama family: RoPE rotates adjacent pairs (complex form), RoPE
layers attend within chunks of `attention_chunk_size` and normalise q/k after RoPE, NoPE
layers attend globally and scale queries with position ("temperature tuning"), and MoE layers
scale each expert's *input* by a sigmoid router score and add a shared expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import CHUNKED
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import MoE, Routing, StackedExperts, act_glu
from hybridkv.models.layers.norms import rms_normalize
from hybridkv.models.layers.rotary import apply_rope_pairs, rope_inv_freq, rope_params
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class Llama4Attention(Attention):
    """Pairs RoPE, then (RoPE layers) q/k RMS-normalised, or (NoPE layers) queries scaled by
    log(1 + floor((position + 1) / floor_scale)) * attn_scale + 1."""

    def __init__(self, cfg: TextConfig, layer: int, chunked: bool) -> None:
        raw = cfg.raw
        flags = raw.get("no_rope_layers")
        shape = AttentionShape.from_config(cfg)
        params = AttentionParams(
            scale=cfg.head_dim ** -0.5,
            chunk_size=int(raw["attention_chunk_size"]) if chunked else None)
        super().__init__(layer, shape, params, rotary=None)
        self.use_rope = bool(flags[layer]) if flags else chunked  # 1 = uses RoPE
        self.qk_norm = bool(raw.get("use_qk_norm", True)) and self.use_rope
        self.eps = cfg.rms_norm_eps
        self.temperature_tuning = bool(raw.get("attn_temperature_tuning", True)) and \
            not self.use_rope
        self.floor_scale = float(raw.get("floor_scale", 8192))
        self.attn_scale = float(raw.get("attn_scale", 0.1))
        inv_freq, _ = rope_inv_freq(cfg.head_dim, rope_params(raw, CHUNKED))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        q_out, k_out, v_out = self.project(h)
        q, _ = self.queries(q_out)
        k, v = self.keys_values(k_out, v_out)
        assert k is not None
        if self.use_rope:
            q = apply_rope_pairs(q, positions, self.inv_freq)
            k = apply_rope_pairs(k, positions, self.inv_freq)
        if self.qk_norm:
            q, k = rms_normalize(q, self.eps, fused=False), rms_normalize(k, self.eps,
                                                                          fused=False)
        if self.temperature_tuning:
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale))
            q = (q * (scales * self.attn_scale + 1.0).view(-1, 1, 1)).to(q.dtype)
        return self.attend(q, k, v, None, ctx)


def llama4_moe(cfg: TextConfig) -> MoE:
    num_experts, act = int(cfg.raw["num_local_experts"]), cfg.hidden_act
    experts = StackedExperts(num_experts, cfg.hidden_size, cfg.intermediate_size,
                             act_glu(act), transposed=True)
    return MoE(cfg.hidden_size, experts,
               Routing(int(cfg.raw.get("num_experts_per_tok", 1)), "sigmoid"),
               shared_expert=GatedMLP(cfg.hidden_size, cfg.intermediate_size, act),
               scale_inputs=True)


def llama4_layer(cfg: TextConfig, layer: int, chunked: bool, moe: bool) -> DecoderLayer:
    ffn = llama4_moe(cfg) if moe else GatedMLP(
        cfg.hidden_size, int(cfg.raw.get("intermediate_size_mlp") or cfg.intermediate_size),
        cfg.hidden_act)
    return DecoderLayer(LayerNames("self_attn", ffns=("feed_forward",)),
                        Llama4Attention(cfg, layer, chunked), [ffn], cfg.hidden_size,
                        cfg.rms_norm_eps)


class Llama4ForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config.get("text_config") or config, eps=1e-5)
        step = int(cfg.raw.get("interleave_moe_layer_step", 1))
        moe_layers = cfg.raw.get("moe_layers")
        if moe_layers is None:
            moe_layers = [i for i in range(cfg.num_layers) if (i + 1) % step == 0] \
                if step else []
        super().__init__(cfg, (llama4_layer(cfg, i, kind == CHUNKED, i in set(moe_layers))
                               for i, kind in enumerate(cfg.kinds)))
