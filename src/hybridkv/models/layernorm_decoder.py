"""Llama-shaped decoders whose norms are LayerNorms with a bias: StarCoder 2 (a plain
`c_fc -> act -> c_proj` MLP, biases everywhere when `use_bias`) and PhiMoE (a top-2
SparseMixer MoE, optional attention and lm_head biases). Every layer slides when the config
gives a `sliding_window` (layer_mix). Their checkpoints name the MLP / MoE parts their own
way (`c_fc`, `block_sparse_moe.experts.N.w1`); they are renamed on load to the kit's names.

Not supported: the "longrope" RoPE of the long-context Phi checkpoints (Rotary refuses it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, SLIDING
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mlp import MLP
from hybridkv.models.layers.moe import ExpertMLPs
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.layers.sparsemixer import sparsemixer_top2
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed
from hybridkv.worker.attention.backend import AttentionParams

CHECKPOINT_NAMES = (
    (r"\.mlp\.c_fc\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    (r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
    (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."))


class SparseMixerMoE(nn.Module):
    """x [T, hidden] -> the SparseMixer-weighted sum of its two experts' outputs."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        raw = cfg.raw
        if int(raw.get("num_experts_per_tok", 2)) != 2:
            raise NotImplementedError("phimoe: SparseMixer routing picks 2 experts; "
                                      f"num_experts_per_tok={raw['num_experts_per_tok']}")
        num_experts = int(raw["num_local_experts"])
        self.jitter_eps = float(raw.get("router_jitter_noise", 0.01))
        self.gate = nn.Linear(cfg.hidden_size, num_experts, bias=False)
        self.experts = ExpertMLPs(num_experts, cfg.hidden_size, cfg.intermediate_size,
                                  cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sparsemixer_top2(self.gate(x), self.jitter_eps)
        return self.experts(x, weights.to(x.dtype), ids)  # type: ignore[no-any-return]


def decoder_layer(cfg: TextConfig, layer: int, kind: str, eps: float) -> DecoderLayer:
    starcoder = cfg.model_type == "starcoder2"
    bias = bool(cfg.raw.get("use_bias", True)) if starcoder else cfg.attention_bias
    attn = Attention(layer, AttentionShape.from_config(cfg, bias=bias),
                     AttentionParams(scale=cfg.head_dim ** -0.5, sliding_window=(
                         cfg.sliding_window if kind == SLIDING else None)),
                     rotary=Rotary.from_config(cfg.raw, cfg.head_dim, kind))
    ffn = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=bias) if starcoder \
        else SparseMixerMoE(cfg)
    return DecoderLayer(LayerNames("self_attn"), attn, [ffn], cfg.hidden_size, eps,
                        norm=lambda dim, eps: nn.LayerNorm(dim, eps=eps))


class LayerNormDecoderForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        # StarCoder 2 ties the lm_head to the embedding unless config.json says otherwise.
        cfg = TextConfig.from_hf(config, tied=config.get("model_type") == "starcoder2")
        raw = cfg.raw
        eps = float(raw.get("norm_epsilon") or raw.get("rms_norm_eps") or 1e-5)
        kinds = [kind or FULL for kind in cfg.kinds]
        super().__init__(cfg, (decoder_layer(cfg, i, k, eps) for i, k in enumerate(kinds)))
        self.model.norm = nn.LayerNorm(cfg.hidden_size, eps=eps)
        if raw.get("lm_head_bias"):
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(renamed(weights, CHECKPOINT_NAMES))
