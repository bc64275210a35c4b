"""Pure state-space models: Mamba, Falcon-Mamba (Mamba1 mixers) and Mamba2. Every layer is
`h + mixer(norm(h))`, no attention and no MLP, so the KV cache holds one state group and
nothing else; prefix hits come from state checkpoints alone. Checkpoints keep the model
under `backbone.` (read as `model.`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layers.decoder_layer import DecoderLayer, LayerNames
from hybridkv.models.layers.mamba1_plain import PlainMamba1Mixer
from hybridkv.models.layers.mamba2 import Mamba2Mixer
from hybridkv.models.text_config import TextConfig

MIXER_ONLY = LayerNames("mixer", mixer_norm="norm", ffn_norm=None, ffns=())


def mamba2_mixer_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A Mamba2 config in the field names Mamba2Mixer reads (the hybrids' `mamba_*`)."""
    return dict(hidden_size=cfg["hidden_size"], mamba_num_heads=cfg["num_heads"],
                mamba_head_dim=cfg["head_dim"], ssm_state_size=cfg.get("state_size", 128),
                n_groups=cfg.get("n_groups", 1), conv_kernel=cfg.get("conv_kernel", 4),
                mamba_d_ssm=int(cfg.get("expand", 2)) * int(cfg["hidden_size"]),
                chunk_size=cfg.get("chunk_size", 256), use_bias=cfg.get("use_bias", False),
                use_conv_bias=cfg.get("use_conv_bias", True),
                time_step_limit=cfg.get("time_step_limit"),
                layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5))


class MambaForCausalLM(CausalLM):
    embed_name = "embeddings"
    norm_name = "norm_f"

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = TextConfig.from_hf(config, eps=1e-5, tied=True)
        raw, model_type = cfg.raw, cfg.model_type
        if raw.get("rms_norm") is False:
            raise NotImplementedError(f"{model_type}: rms_norm=false (no gated norm in the "
                                      f"Mamba2 mixer) is not supported")
        super().__init__(cfg, (DecoderLayer(MIXER_ONLY, self._mixer(raw, model_type, i), [],
                                            cfg.hidden_size, cfg.rms_norm_eps)
                               for i in range(cfg.num_layers)))

    @staticmethod
    def _mixer(raw: Mapping[str, Any], model_type: str, layer: int) -> nn.Module:
        if model_type == "mamba2":
            return Mamba2Mixer(mamba2_mixer_config(raw), layer)
        # Falcon-Mamba RMS-normalises dt, B and C (no weights); Mamba does not.
        eps = float(raw.get("mixer_rms_eps", 1e-6)) if model_type == "falcon_mamba" else None
        return PlainMamba1Mixer(raw, layer, norm_eps=eps)
