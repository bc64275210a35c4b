"""Gemma 3n text: AltUp, Laurel, per-layer inputs, activation sparsity and KV sharing.

- AltUp keeps `altup_num_inputs` copies of the hidden state; each layer runs on one
  ("active") copy predicted from all of them, then corrects every copy with its output.
- Laurel adds a low-rank residual branch next to attention.
- Per-layer inputs: a second embedding table gives every token a small vector per layer,
  mixed with a projection of the token's embedding, gated into each layer's output.
- Activation sparsity: in the first layers the MLP gate keeps only its largest values.
- KV sharing: the last `num_kv_shared_layers` layers compute queries only and read the KV
  cache of the last earlier layer of their attention type (`layer_mix.kv_sharing_targets`);
  with `kv_sharing_fast_prefill` they run on the sampled tokens only.

Attention (shared with Gemma 4): q/k norms, a scale-free v norm, scaling 1, RoPE per layer
type. Hidden states are token-major here: [altup, tokens, hidden].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, SLIDING
from hybridkv.models.layers import altup
from hybridkv.models.layers.altup import AltUp
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.laurel import Laurel
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.per_layer_inputs import PerLayerInputLayer, PerLayerInputsModel
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import MULTIMODAL_PARTS
from hybridkv.worker.attention.backend import AttentionParams
from hybridkv.worker.forward_context import ForwardContext


class Gemma3nDecoderLayer(PerLayerInputLayer):
    def __init__(self, cfg: TextConfig, layer: int, kind: str, sparsity: float) -> None:
        super().__init__()
        raw, hidden, eps = cfg.raw, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(
            layer, AttentionShape.from_config(cfg, qk_norm=True, value_norm=True),
            AttentionParams(scale=1.0,
                            sliding_window=cfg.sliding_window if kind == SLIDING else None),
            rotary=Rotary.from_config(raw, cfg.head_dim, kind),
            reads_shared_kv=layer in cfg.kv_targets)
        self.mlp = GatedMLP(hidden, cfg.intermediate_sizes[layer], cfg.hidden_act,
                            activation_sparsity=sparsity)
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            self.add_module(norm, RMSNorm(hidden, eps))
        self.altup = AltUp(hidden, int(raw.get("altup_num_inputs", 4)),
                           int(raw.get("altup_active_idx", 0)), eps)
        self.correct_scale = bool(raw.get("altup_correct_scale", True))
        self.laurel = Laurel(hidden, int(raw.get("laurel_rank", 64)), eps)
        self.init_per_layer_input(hidden, int(raw["hidden_size_per_layer_input"]),
                                  cfg.hidden_act, eps)

    def forward(self, hs: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                per_layer_input: torch.Tensor) -> torch.Tensor:
        predictions = self.altup.predict(hs)
        active = predictions[self.altup.active]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)
        attn = self.post_attention_layernorm(self.self_attn(normed, positions, ctx))
        attn_laurel = (active + attn + laurel) / math.sqrt(2)
        ffw = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(
            attn_laurel)))
        corrected = self.altup.correct(predictions, attn_laurel + ffw)
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = first * self.altup.correct_output_scale
        extra = self.per_layer_residual(first, per_layer_input)
        return torch.cat([corrected[:1], corrected[1:] + extra], dim=0)


class Gemma3nForCausalLM(CausalLM):
    supports_kv_sharing = True
    unused_prefixes = MULTIMODAL_PARTS

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, act="gelu_pytorch_tanh", tied=True)
        raw, hidden, n = cfg.raw, cfg.hidden_size, cfg.num_layers
        sparsity = raw.get("activation_sparsity_pattern")
        if sparsity is None:  # transformers' default: the first 10 layers are sparse
            sparsity = [0.95 if i < 10 and n > 10 else 0.0 for i in range(n)]
        model = PerLayerInputsModel(
            hidden, n, int(raw["hidden_size_per_layer_input"]),
            int(raw.get("vocab_size_per_layer_input") or cfg.vocab_size), cfg.rms_norm_eps)
        super().__init__(cfg, (Gemma3nDecoderLayer(cfg, i, kind or FULL, float(sparsity[i]))
                               for i, kind in enumerate(cfg.kinds)),
                         embed_scale=hidden ** 0.5, model=model)
        copies = range(1, int(raw.get("altup_num_inputs", 4)))
        model.altup_projections = nn.ModuleList(
            nn.Linear(hidden, hidden, bias=False) for _ in copies)
        model.altup_unembed_projections = nn.ModuleList(
            nn.Linear(hidden, hidden, bias=False) for _ in copies)

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.model.per_layer_inputs(input_ids, h)  # type: ignore[no-any-return,operator]

    def enter_layers(self, h: torch.Tensor) -> torch.Tensor:
        return altup.expand(h, self.model.altup_projections)  # type: ignore[arg-type]

    def leave_layers(self, h: torch.Tensor) -> torch.Tensor:
        return altup.collapse(h, self.model.altup_unembed_projections)  # type: ignore[arg-type]
