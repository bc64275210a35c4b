"""Model families by `model_type`; an unknown one fails listing what is supported."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from hybridkv.models.bamba import BambaForCausalLM
from hybridkv.models.falcon_h1 import FalconH1ForCausalLM
from hybridkv.models.gemma3n import Gemma3nForCausalLM
from hybridkv.models.gemma4 import Gemma4ForCausalLM
from hybridkv.models.granite_hybrid import GraniteMoeHybridForCausalLM
from hybridkv.models.jamba import JambaForCausalLM
from hybridkv.models.layer_mix import kv_sharing_targets
from hybridkv.models.llama import DecoderConfig, DecoderForCausalLM
from hybridkv.models.llama4 import Llama4ForCausalLM
from hybridkv.models.nemotron_h import NemotronHForCausalLM
from hybridkv.models.qwen3_next import Qwen3NextForCausalLM


def _decoder(config: Mapping[str, Any]) -> nn.Module:
    return DecoderForCausalLM(DecoderConfig.from_hf(config))


MODELS: dict[str, Callable[[Mapping[str, Any]], nn.Module]] = {
    name: _decoder for name in ("llama", "mistral", "qwen3", "gemma2", "gemma3_text",
                                       "gpt_oss")
}
MODELS["llama4_text"] = Llama4ForCausalLM
MODELS["nemotron_h"] = NemotronHForCausalLM
MODELS["bamba"] = BambaForCausalLM
MODELS["granitemoehybrid"] = GraniteMoeHybridForCausalLM
MODELS["jamba"] = JambaForCausalLM
MODELS["falcon_h1"] = FalconH1ForCausalLM
MODELS["qwen3_next"] = Qwen3NextForCausalLM
MODELS["gemma3n_text"] = MODELS["gemma3n"] = Gemma3nForCausalLM
MODELS["gemma4_text"] = MODELS["gemma4"] = Gemma4ForCausalLM


# Families whose attention reads a target layer's cache when the config says so.
KV_SHARING_MODELS = {"llama", "mistral", "qwen3", "gemma2", "gemma3_text", "gpt_oss",
                     "gemma3n", "gemma3n_text", "gemma4", "gemma4_text"}


def build_model(config: Mapping[str, Any]) -> nn.Module:
    cfg = config.get("text_config") or config
    model_type = str(cfg.get("model_type") or config.get("model_type"))
    try:
        factory = MODELS[model_type]
    except KeyError:
        raise ValueError(f"unsupported architecture model_type={model_type!r} (architectures "
                         f"{config.get('architectures')}); supported: "
                         f"{', '.join(sorted(MODELS))}") from None
    if kv_sharing_targets(config) and model_type not in KV_SHARING_MODELS:
        # Other families would compute and write their own K/V into the target's cache.
        raise NotImplementedError(
            f"{model_type}: layers reading another layer's KV cache (num_kv_shared_layers / "
            f"kv_sharing_target_layers) are not supported for this architecture; supported: "
            f"{', '.join(sorted(KV_SHARING_MODELS))}")
    return factory(config)
