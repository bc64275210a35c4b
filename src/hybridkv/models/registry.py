"""Model families by `model_type`, imported on first use; an unknown one fails listing what is
supported. What a family can do is read from its class (e.g. `supports_kv_sharing`), not
from lists kept here."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Any

from hybridkv.models.base import CausalLM
from hybridkv.models.layer_mix import kv_sharing_targets

_LLAMA = "hybridkv.models.llama:DecoderForCausalLM"
_SLIDING_MOE = "hybridkv.models.sliding_moe:SlidingMoEForCausalLM"
# model_type -> "module:class"
MODELS: dict[str, str] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen3": _LLAMA, "gemma2": _LLAMA,
    "gemma3_text": _LLAMA, "gpt_oss": _LLAMA,
    "mixtral": _LLAMA, "qwen2": _LLAMA, "qwen2_moe": _LLAMA, "qwen3_moe": _LLAMA,
    "phi3": _LLAMA, "ministral": _LLAMA, "smollm3": _LLAMA,
    "starcoder2": "hybridkv.models.layernorm_decoder:LayerNormDecoderForCausalLM",
    "phimoe": "hybridkv.models.layernorm_decoder:LayerNormDecoderForCausalLM",
    "cohere2": "hybridkv.models.cohere2:Cohere2ForCausalLM",
    "cohere2_moe": "hybridkv.models.cohere2:Cohere2ForCausalLM",
    "exaone4": "hybridkv.models.postnorm:PostNormForCausalLM",
    "olmo3": "hybridkv.models.postnorm:PostNormForCausalLM",
    "granite_swa": "hybridkv.models.granite_swa:GraniteSWAForCausalLM",
    "granitemoe_swa": "hybridkv.models.granite_swa:GraniteSWAForCausalLM",
    "vaultgemma": _LLAMA, "ministral3": _LLAMA,
    "dots1": "hybridkv.models.grouped_moe:GroupedMoEForCausalLM",
    "exaone_moe": "hybridkv.models.grouped_moe:GroupedMoEForCausalLM",
    "afmoe": "hybridkv.models.afmoe:AfmoeForCausalLM",
    "mimo_v2_flash": "hybridkv.models.grouped_moe:GroupedMoEForCausalLM",
    # Gemma 4's text decoder without per-layer inputs or MoE (their config fields are off).
    "gemma4_unified_text": "hybridkv.models.gemma4:Gemma4ForCausalLM",
    "llama4_text": "hybridkv.models.llama4:Llama4ForCausalLM",
    "nemotron_h": "hybridkv.models.nemotron_h:NemotronHForCausalLM",
    "bamba": "hybridkv.models.bamba:BambaForCausalLM",
    "granitemoehybrid": "hybridkv.models.granite_hybrid:GraniteMoeHybridForCausalLM",
    "jamba": "hybridkv.models.jamba:JambaForCausalLM",
    "falcon_h1": "hybridkv.models.falcon_h1:FalconH1ForCausalLM",
    "qwen3_next": "hybridkv.models.qwen3_next:Qwen3NextForCausalLM",
    "qwen3_5_text": "hybridkv.models.qwen3_next:Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "hybridkv.models.qwen3_next:Qwen3NextForCausalLM",
    "mamba": "hybridkv.models.mamba:MambaForCausalLM",
    "falcon_mamba": "hybridkv.models.mamba:MambaForCausalLM",
    "mamba2": "hybridkv.models.mamba:MambaForCausalLM",
    "lfm2": "hybridkv.models.lfm2:Lfm2ForCausalLM",
    "lfm2_moe": "hybridkv.models.lfm2:Lfm2ForCausalLM",
    "lfm3": "hybridkv.models.lfm2:Lfm2ForCausalLM",
    "recurrent_gemma": "hybridkv.models.recurrent_gemma:RecurrentGemmaForCausalLM",
    "minimax": "hybridkv.models.minimax:MiniMaxForCausalLM",
    "kimi_linear": "hybridkv.models.kimi_linear:KimiLinearForCausalLM",
    "bailing_hybrid": "hybridkv.models.bailing_hybrid:BailingHybridForCausalLM",
    "olmo_hybrid": "hybridkv.models.olmo_hybrid:OlmoHybridForCausalLM",
    "rwkv": "hybridkv.models.rwkv:RwkvForCausalLM",
    "xlstm": "hybridkv.models.xlstm:XLstmForCausalLM",
    "gemma3n": "hybridkv.models.gemma3n:Gemma3nForCausalLM",
    "gemma3n_text": "hybridkv.models.gemma3n:Gemma3nForCausalLM",
    "gemma4": "hybridkv.models.gemma4:Gemma4ForCausalLM",
    "gemma4_text": "hybridkv.models.gemma4:Gemma4ForCausalLM",
    "zamba2": "hybridkv.models.zamba:Zamba2ForCausalLM",
    "zamba": "hybridkv.models.zamba:ZambaForCausalLM",
    "cwm": _LLAMA,
    "flint": _SLIDING_MOE, "kolibri1": _SLIDING_MOE, "laguna": _SLIDING_MOE,
    "mellum": _SLIDING_MOE,
    "modernbert-decoder": "hybridkv.models.modernbert_decoder:ModernBertDecoderForCausalLM",
    "beam": "hybridkv.models.beam:BeamForCausalLM",
    "zaya": "hybridkv.models.zaya:ZayaForCausalLM",
    "doge": "hybridkv.models.doge:DogeForCausalLM",
    "dots3_note_text": "hybridkv.models.dots3_note:Dots3NoteForCausalLM",
    "qwen4_exp_text": "hybridkv.models.qwen4_exp:Qwen4ExpForCausalLM",
    "inkling_text": "hybridkv.models.inkling:InklingForCausalLM",
    "inkling2_text": "hybridkv.models.inkling2:Inkling2ForCausalLM",
    "deepseek_v4": "hybridkv.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def model_class(model_type: str) -> type[CausalLM]:
    try:
        module, name = MODELS[model_type].split(":")
    except KeyError:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: "
                         f"{', '.join(sorted(MODELS))}") from None
    cls: type[CausalLM] = getattr(import_module(module), name)
    return cls


def build_model(config: Mapping[str, Any]) -> CausalLM:
    cfg = config.get("text_config") or config
    model_type = str(cfg.get("model_type") or config.get("model_type"))
    if model_type not in MODELS:
        raise ValueError(f"unsupported architecture model_type={model_type!r} (architectures "
                         f"{config.get('architectures')}); supported: "
                         f"{', '.join(sorted(MODELS))}")
    cls = model_class(model_type)
    if kv_sharing_targets(config) and not cls.supports_kv_sharing:
        # Other families would compute and write their own K/V into the target's cache.
        supported = sorted(t for t in MODELS if model_class(t).supports_kv_sharing)
        raise NotImplementedError(
            f"{model_type}: layers reading another layer's KV cache (num_kv_shared_layers / "
            f"kv_sharing_target_layers) are not supported for this architecture; supported: "
            f"{', '.join(supported)}")
    return cls(config)  # type: ignore[call-arg,arg-type]  # families take the HF dict
