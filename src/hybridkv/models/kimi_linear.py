"""Kimi Linear: Kimi Delta Attention (layers/kda.py) on most layers, multi-head latent
attention without RoPE (layers/mla.py, `mla_use_nope`) on every 4th, a dense MLP on the
first `first_k_dense_replace` layers and DeepSeek-V3-style routed experts plus a shared
expert on the rest (layers/grouped_topk.py).

KDA's decay and output gate are low-rank: decay = -exp(A_log) * softplus(f_b(f_a(h)) +
dt_bias) per channel, gate = g_b(g_a(h)). Checkpoints keep the MLPs as `block_sparse_moe`
(experts w1 / w3 / w2) and the KDA conv as three (q/k/v) convs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import KDA, kda_shape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.kda import KimiDeltaAttention, fuse_qkv_conv
from hybridkv.models.layers.mla import LatentAttention
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.routed_moe import is_sparse, routed_moe
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import renamed

MOE_NAMES = ((r"\.block_sparse_moe\.", ".mlp."), (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
             (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
             (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."))


class KimiKDA(KimiDeltaAttention):
    def __init__(self, cfg: TextConfig, layer: int) -> None:
        heads, head_dim, kernel = kda_shape(cfg.raw)
        super().__init__(layer, cfg.hidden_size, heads, head_dim, kernel, cfg.rms_norm_eps,
                         cfg.hidden_act)
        width = heads * head_dim
        self.f_a_proj = nn.Linear(cfg.hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1))
        self.g_a_proj = nn.Linear(cfg.hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def decay(self, h: torch.Tensor) -> torch.Tensor:
        x = (self.f_b_proj(self.f_a_proj(h)).float() + self.dt_bias.float()).unflatten(
            -1, (self.num_heads, self.head_dim))
        softplus = torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))  # as the reference
        return -self.A_log.float().exp()[0, 0] * softplus

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        return self.g_b_proj(self.g_a_proj(h)).unflatten(  # type: ignore[no-any-return]
            -1, (self.num_heads, self.head_dim))

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o)  # type: ignore[no-any-return]


def kimi_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    raw = cfg.raw
    mixer: nn.Module
    if kind == KDA:
        mixer = KimiKDA(cfg, layer)
    else:
        head = int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])
        mixer = LatentAttention(raw, layer, scale=head ** -0.5, rotary=None)
    mlp: nn.Module = routed_moe(raw, cfg.hidden_size, cfg.hidden_act) if is_sparse(
        raw, layer, first_dense=1) else GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                                 cfg.hidden_act)
    return DecoderLayer(LayerNames("self_attn"), mixer, [mlp], cfg.hidden_size, cfg.rms_norm_eps)


class KimiLinearForCausalLM(CausalLM):
    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-5)
        if cfg.raw.get("mla_use_nope") is False:
            raise NotImplementedError("kimi_linear: mla_use_nope=false (RoPE in the MLA "
                                      "layers) is not supported; accepted: true")
        super().__init__(cfg, (kimi_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(fuse_qkv_conv(renamed(weights, MOE_NAMES)))

