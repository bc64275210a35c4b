"""NemotronH: one mixer per layer (Mamba2, attention without RoPE, relu² MLP), pre-norm
residual blocks. The mix comes from `layer_mix` like every model's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import FULL, MAMBA
from hybridkv.models.layers.attention import Attention, AttentionShape
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mamba2 import Mamba2Mixer
from hybridkv.models.layers.mlp import MLP
from hybridkv.models.text_config import TextConfig
from hybridkv.worker.attention.backend import AttentionParams

MIXER = LayerNames("mixer", mixer_norm="norm", ffn_norm=None, ffns=())
MLP_ONLY = LayerNames(None, mixer_norm=None, ffn_norm="norm", ffns=("mixer",))


def nemotron_h_layer(cfg: TextConfig, layer: int, kind: str | None) -> DecoderLayer:
    hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
    if kind is None:
        mlp = MLP(hidden, cfg.intermediate_size, "relu2", bias=bool(cfg.raw.get("mlp_bias")))
        return DecoderLayer(MLP_ONLY, None, [mlp], hidden, eps)
    if kind == MAMBA:
        return DecoderLayer(MIXER, Mamba2Mixer(cfg.raw, layer), [], hidden, eps)
    if kind == FULL:  # attention without positions
        attn = Attention(layer, AttentionShape.from_config(cfg),
                         AttentionParams(scale=cfg.head_dim ** -0.5), rotary=None)
        return DecoderLayer(MIXER, attn, [], hidden, eps)
    raise NotImplementedError(f"NemotronH layer {layer}: {kind} mixers are not supported yet")


class NemotronHForCausalLM(CausalLM):
    embed_name = "embeddings"
    norm_name = "norm_f"

    def __init__(self, config: Mapping[str, Any]) -> None:
        pattern = config.get("hybrid_override_pattern") or ""
        if "E" in pattern or "moe" in (config.get("layers_block_type") or []):
            raise NotImplementedError("NemotronH MoE layers are not supported yet")
        cfg = TextConfig.from_hf(config, eps=1e-5)
        super().__init__(cfg, (nemotron_h_layer(cfg, i, k) for i, k in enumerate(cfg.kinds)))
