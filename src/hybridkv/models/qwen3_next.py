"""Qwen3-Next and Qwen3.5: Gated DeltaNet linear attention (a fixed-size state per request)
on three of every four layers, gated full attention on the fourth (q_proj also yields a
sigmoid output gate per head; q/k normalised per head; RoPE on part of each head), a top-k
MoE with a sigmoid-gated shared expert after each (a dense MLP in Qwen3.5's dense models).
Norms are zero-centred: `x * (1 + w)`.

Qwen3.5 stores the DeltaNet projections apart (SplitGatedDeltaNet) and gives its attention
multimodal RoPE sections; text tokens have equal temporal/height/width positions, where the
sections all rotate by the same position and plain RoPE is the same numbers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, LINEAR
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.gated_deltanet import GatedDeltaNet
from hybridkv.models.layers.gated_deltanet_split import SplitGatedDeltaNet
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.moe import ExpertMLPs, MoE, Routing
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams

QWEN3_5_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def sparse_moe(cfg: TextConfig) -> MoE:
    raw, hidden, act = cfg.raw, cfg.hidden_size, cfg.hidden_act
    experts = ExpertMLPs(int(raw["num_experts"]), hidden, int(raw["moe_intermediate_size"]),
                         act)
    routing = Routing(int(raw["num_experts_per_tok"]), "softmax",
                      renormalize=bool(raw.get("norm_topk_prob", True)))
    shared = GatedMLP(hidden, int(raw["shared_expert_intermediate_size"]), act)
    return MoE(hidden, experts, routing, router_name="gate", shared_expert=shared,
               shared_expert_gate=True)


def qwen3_next_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    raw = cfg.raw
    mixer: nn.Module
    if kind == LINEAR:
        split = cfg.model_type in QWEN3_5_TYPES
        name, mixer = "linear_attn", (SplitGatedDeltaNet if split else GatedDeltaNet)(raw, layer)
    else:
        shape = AttentionShape.from_config(cfg, qk_norm=True, norm_offset=1.0,
                                           output_gate=True)
        name, mixer = "self_attn", Attention(
            layer, shape, AttentionParams(scale=cfg.head_dim ** -0.5),
            rotary=Rotary.from_config(raw, cfg.head_dim, FULL))
    sparse = int(raw.get("num_experts") or 0) > 0 and \
        layer not in (raw.get("mlp_only_layers") or []) and \
        (layer + 1) % int(raw.get("decoder_sparse_step", 1)) == 0
    mlp: nn.Module = sparse_moe(cfg) if sparse else GatedMLP(
        cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    return DecoderLayer(LayerNames(name), mixer, [mlp], cfg.hidden_size, cfg.rms_norm_eps,
                        norm_offset=1.0)


class Qwen3NextForCausalLM(CausalLM):
    # Qwen3.5 checkpoints hold a vision tower and multi-token-prediction layers beside the
    # language model; text generation runs neither.
    unused_prefixes = ("model.visual.", "mtp.")

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config)
        super().__init__(cfg, (qwen3_next_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)),
                         norm_offset=1.0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert(weights))


def per_expert(weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Released Qwen3.5-MoE checkpoints stack the experts (`mlp.experts.gate_up_proj`
    [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]); transformers writes
    one module per expert. Both load: stacked tensors are cut into per-expert ones."""
    for name, tensor in weights:
        stem, _, part = name.rpartition(".")
        if not stem.endswith(".mlp.experts") or part not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        for e in range(tensor.shape[0]):
            if part == "down_proj":
                yield f"{stem}.{e}.down_proj.weight", tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{stem}.{e}.gate_proj.weight", gate
                yield f"{stem}.{e}.up_proj.weight", up
