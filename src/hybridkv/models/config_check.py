"""Checks of a Hugging Face `config.json` before anything is built from it: each problem is
one line naming the file and the field, instead of a KeyError or a shape error deep inside
a model (or, worse, a plan that silently covers only some layers). Needs no torch: `hybridkv
plan` runs it too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# What the planner needs of the text config, and what building the model needs besides.
PLAN_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers")
MODEL_FIELDS = (*PLAN_FIELDS, "vocab_size", "intermediate_size")
# Per-layer kinds; where present each must have one entry per layer.
LAYER_LISTS = ("layer_types", "layers_block_type", "hybrid_override_pattern")
# Pure state-space models: no attention layer, so no attention heads to read.
ATTENTION_FREE = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
# Positive integers where present.
OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings",
                 "sliding_window", "attention_chunk_size")


def _times_hidden(factor_field: str, default: int) -> Any:
    return lambda cfg: int(cfg.get(factor_field) or default) * int(cfg["hidden_size"])


# (model_type, field) -> the value transformers' config class (or model) derives when a config
# leaves the field out or null, from fields it does give; None where the family never reads it.
DERIVED_FIELDS: dict[tuple[str, str], Any] = {
    # Mamba's width is expand x hidden (Mamba2's config has no intermediate_size at all).
    **{(t, "intermediate_size"): _times_hidden("expand", 2)
       for t in ("mamba", "falcon_mamba", "mamba2")},
    ("rwkv", "intermediate_size"): lambda cfg: 4 * int(cfg["hidden_size"]),
    ("rwkv", "attention_hidden_size"): lambda cfg: cfg["hidden_size"],
    ("zamba2", "intermediate_size"): lambda cfg: 4 * int(cfg["hidden_size"]),
    ("lfm2", "intermediate_size"): lambda cfg: cfg.get("block_ff_dim"),  # the older spelling
    # xLSTM's own names (transformers 5 reads them only for null fields; 4.x configs).
    ("xlstm", "hidden_size"): lambda cfg: cfg.get("embedding_dim"),
    ("xlstm", "num_hidden_layers"): lambda cfg: cfg.get("num_blocks"),
    ("xlstm", "intermediate_size"): None,  # sized by ffn_proj_factor
    ("qwen3_5_moe_text", "intermediate_size"): None,  # every layer is MoE
    ("kolibri1", "intermediate_size"): None,  # every layer is MoE
    ("zaya", "intermediate_size"): None,  # every layer is MoE
    ("qwen4_exp_text", "intermediate_size"): None,  # every layer is MoE
    ("inkling2_text", "intermediate_size"): None,  # every layer is MoE (moe_intermediate_size)
    ("deepseek_v4", "intermediate_size"): None,  # every layer is MoE (moe_intermediate_size)
    # ModernBERT-Decoder's window is half of its encoder's `local_attention`.
    ("modernbert-decoder", "sliding_window"):
        lambda cfg: int(cfg["local_attention"]) // 2 if cfg.get("local_attention") else None,
}


def with_derived_fields(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text config with the fields of DERIVED_FIELDS it leaves out filled in (where their
    sources are given), as transformers fills them in."""
    model_type = cfg.get("model_type")
    out: dict[str, Any] | None = None
    for (family, name), derive in DERIVED_FIELDS.items():
        if family != model_type or derive is None or cfg.get(name) is not None:
            continue
        source = out if out is not None else cfg
        if source.get("hidden_size") is None and name != "hidden_size":
            continue  # reported as missing by check_config
        out = dict(cfg) if out is None else out
        out[name] = derive(out)
    return cfg if out is None else out


def check_config(config: object, source: str, *, for_model: bool) -> None:
    """Raise ValueError naming `source` (e.g. '/models/x/config.json') and the field."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{source}: expected a JSON object, got {type(config).__name__}")
    text = config.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        raise ValueError(f"{source}: text_config must be an object, got "
                         f"{type(text).__name__}")
    cfg: Mapping[str, Any] = with_derived_fields(text if text is not None else config)
    where = f"{source}: " + ("text_config." if text is not None else "")
    for name in MODEL_FIELDS if for_model else PLAN_FIELDS:
        if (cfg.get("model_type"), name) in DERIVED_FIELDS and \
                DERIVED_FIELDS[cfg.get("model_type"), name] is None:
            continue  # a field the family does not have
        if name == "num_hidden_layers" and cfg.get(name) is None and any(
                cfg.get(f) is not None for f in ("layers_block_type",
                                                 "hybrid_override_pattern")):
            continue  # NemotronH: its per-layer pattern alone says how many layers
        if name == "num_attention_heads" and cfg.get("model_type") in ATTENTION_FREE:
            continue
        if cfg.get(name) is None:
            raise ValueError(f"{where}{name} is missing")
        if name == "intermediate_size" and isinstance(cfg[name], list):
            for i, v in enumerate(cfg[name]):  # per layer (Gemma 3n)
                _positive_int(f"{where}{name}[{i}]", v)
            continue
        _positive_int(f"{where}{name}", cfg[name])
    for name in OPTIONAL_INTS:
        if name == "sliding_window" and cfg.get(name) == 0 and \
                not cfg.get("use_sliding_window", True):
            continue  # Qwen2-MoE writes 0 for "no window" when use_sliding_window is off
        if cfg.get(name) is not None:
            _positive_int(f"{where}{name}", cfg[name])
    heads, kv_heads = cfg.get("num_attention_heads") or 1, cfg.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"{where}num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    if cfg.get("head_dim") is None and cfg["hidden_size"] % heads:
        raise ValueError(f"{where}hidden_size ({cfg['hidden_size']}) must be a multiple of "
                         f"num_attention_heads ({heads}) when head_dim is not given")
    num_layers = cfg.get("num_hidden_layers")
    for name in LAYER_LISTS:
        kinds = cfg.get(name)
        if kinds is None:
            continue
        if name == "hybrid_override_pattern":
            if not isinstance(kinds, str) or not kinds:
                raise ValueError(f"{where}{name} must be a non-empty string")
        elif not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise ValueError(f"{where}{name} must be a list of strings")
        if num_layers is None:
            num_layers = len(kinds)
        elif len(kinds) != num_layers:
            raise ValueError(f"{where}{name} has {len(kinds)} entries for "
                             f"num_hidden_layers={num_layers}; give one per layer")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
