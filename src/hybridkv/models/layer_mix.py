"""Read a model's layer mix from a Hugging Face `config.json` and turn it into KV cache specs.

The mix comes from config fields, not from per-model code, so new variants need no change:
`layer_types`, `sliding_window_pattern`, `attention_chunk_size` + `no_rope_layers`,
`layers_block_type`, `hybrid_override_pattern`, `attn_layer_period`/`attn_layer_offset`,
`attn_layer_indices`, `full_attention_interval`, `num_kv_shared_layers`, and the older
`sliding_window` + `use_sliding_window` + `max_window_layers` spelling.
Pure Python: planning a model needs no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hybridkv.kv.spec import (
    ChunkedLocalAttentionSpec,
    CompressedAttentionSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    MLASlidingWindowSpec,
    SlidingWindowSpec,
)
from hybridkv.models.config_check import ATTENTION_FREE, check_config, with_derived_fields

# Layer kinds after reading the config.
FULL, SLIDING, CHUNKED, MAMBA, MAMBA1, LINEAR, NONE = (
    "full", "sliding", "chunked", "mamba", "mamba1", "linear_attention", "none")
CONV = "conv"  # a gated short convolution (LFM2): its last inputs are its state
RG_LRU = "rg_lru"  # Griffin's recurrent block (RecurrentGemma): a conv and an RG-LRU state
LIGHTNING = "lightning"  # MiniMax's decayed linear attention: a [heads, d, d] state
KDA = "kda"  # Kimi Delta Attention: a conv and a [heads, d, d] state, decay per channel
MLA = "mla"  # multi-head latent attention: one latent vector per token in the KV cache
MLA_SLIDING = "mla_sliding"  # the same over a sliding window (dots3_note)
INDEXER = "indexer"  # a lightning indexer's keys, beside its layer's attention (dots3_note)
RWKV = "rwkv"  # an RWKV-4 block: token-shift inputs and the WKV numerator/denominator/max
MLSTM = "mlstm"  # xLSTM's matrix memory: C [heads, dk, dv] and [n | m] [heads, dk + 1]
CCA = "cca"  # Zaya's attention inputs: the q/k convs' last inputs and the delayed values
# DeepSeek-V4: every layer's sliding K=V window, and on compressed layers (CSA, HCA) their
# compressed entries, the CSA indexer's compressed keys and each compressor's state.
V4_SLIDING, CSA, HCA = "v4_sliding", "csa", "hca"
CSA_INDEXER, CSA_STATE, HCA_STATE = "csa_indexer", "csa_state", "hca_state"
SCONV = "sconv"  # Inkling's four short convs per layer (k, v, both branches): last inputs
STATE_KINDS = (MAMBA, MAMBA1, LINEAR, CONV, RG_LRU, LIGHTNING, KDA, RWKV, MLSTM, CCA, SCONV)
# Families of KDA layers beside MLA layers (their "linear_attention" / "full_attention").
KDA_MLA_TYPES = ("kimi_linear", "bailing_hybrid")
# Inkling's text decoders: "hybrid" (full) and "hybrid_sliding" layers, sliding ones with
# their own head sizes (swa_*), each with short convs beside its KV cache.
INKLING_TYPES = ("inkling_text", "inkling2_text")

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3",
    "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "gpt_oss", "llama4",
    "llama4_text", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "jamba",
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
    # issue 16: linear attention, SSM, convolution and recurrence families
    "mamba", "mamba2", "falcon_mamba", "lfm2", "lfm2_moe", "lfm3",
    "recurrent_gemma", "minimax",
    "zamba2", "zamba",  # Mamba backbones with a shared attention block
    # issue 16: sliding + full attention families, dense and MoE decoders
    "qwen2_moe", "phi3", "ministral", "smollm3", "starcoder2", "phimoe",
    "cohere2", "exaone4", "olmo3", "granite_swa", "granitemoe_swa", "vaultgemma",
    "ministral3", "dots1", "exaone_moe", "cohere2_moe", "afmoe", "gemma4_unified_text",
    "mimo_v2_flash",
    # issue 16: KDA linear attention + multi-head latent attention
    "kimi_linear", "bailing_hybrid",
    # issue 16: more linear attention and recurrence families
    "olmo_hybrid", "rwkv", "xlstm",
    # issue 50: sliding + full attention decoders of transformers 5.23
    "cwm", "flint", "kolibri1", "laguna", "mellum", "modernbert-decoder", "beam",
    "zaya", "doge",
    # issue 50: MLA with a lightning indexer (DSA) and sliding MLA layers; Gated DeltaNet
    # with attention over a query-sparse indexer's choice (QSA)
    "dots3_note_text", "qwen4_exp_text",
    # issue 50: attention with a relative bias per query (and Inkling 2's sinks per token)
    # and short convolutions, sliding + full
    *INKLING_TYPES,
    # issue 50: sliding windows beside compressed sparse (CSA) and heavily compressed (HCA)
    # attention
    "deepseek_v4")

_LAYER_TYPE_WORDS = {
    "full_attention": FULL, "attention": FULL, "global": FULL, "global_attention": FULL,
    "sliding_attention": SLIDING, "sliding": SLIDING, "local": SLIDING,
    "chunked_attention": CHUNKED, "chunked": CHUNKED,
    "mamba": MAMBA, "mamba2": MAMBA, "linear_attention": LINEAR, "conv": CONV,
    "mlp": NONE, "moe": NONE,
}
_PATTERN_CHARS = {"M": MAMBA, "*": FULL, "-": NONE, "E": NONE}


@dataclass(frozen=True)
class ModelKVLayout:
    """What the planner needs to know about a model's layers."""

    model_type: str
    layer_specs: dict[str, KVCacheSpec]
    kv_sharing: dict[str, str]  # layer -> layer whose KV cache it reads
    layer_kinds: tuple[tuple[str, ...], ...]  # per decoder layer, its KV-holding parts
    max_position_embeddings: int | None


def shipped_config_names() -> list[str]:
    """Short names of the model configs shipped with the package (`gemma-3-27b-it`, ...)."""
    folder = resources.files("hybridkv") / "data" / "model_configs"
    return sorted(p.name.split("__", 1)[-1][:-5] for p in folder.iterdir()
                  if p.name.endswith(".json"))


def load_hf_config(source: str) -> dict[str, Any]:
    """A model directory, a `config.json` path, a GGUF file (or a directory holding one), the
    short name of a real model installed from PyPI, or the short name of a shipped config."""
    from hybridkv.models.formats.gguf_config import config_from_gguf
    from hybridkv.models.formats.gguf_file import read_header
    from hybridkv.models.sources import REAL_MODELS, resolve_model

    path = Path(source)
    shipped = source.lower() in shipped_config_names()
    if path.exists() or (source.lower() in REAL_MODELS and not shipped):
        model = resolve_model(source)
        if model.is_gguf:
            return config_from_gguf(read_header(model.path))
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"{source}: no config.json in this directory")
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
        return config
    wanted = source.lower().rsplit("/", 1)[-1]
    folder = resources.files("hybridkv") / "data" / "model_configs"
    for entry in folder.iterdir():
        if entry.name.lower().split("__", 1)[-1] == wanted + ".json":
            return dict(json.loads(entry.read_text()))
    raise ValueError(f"{source!r} is neither a model directory, a config.json nor a shipped "
                     f"model name; shipped: {', '.join(shipped_config_names())}")


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return with_family_defaults(text if isinstance(text, Mapping) else config)


def with_family_defaults(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text config with the defaults transformers derives for fields a config may leave
    out: those the config checker derives too (config_check.DERIVED_FIELDS: Mamba's and
    RWKV's widths, ...), and OLMo Hybrid's layer mix and Gated DeltaNet shapes."""
    cfg = with_derived_fields(cfg)
    if cfg.get("model_type") == "dots3_note_text":
        return dots3_defaults(cfg)
    if cfg.get("model_type") in INKLING_TYPES:
        return inkling_defaults(cfg)
    if cfg.get("model_type") != "olmo_hybrid":
        return cfg
    out = dict(cfg)
    heads, n = int(cfg.get("num_attention_heads") or 1), int(cfg.get("num_hidden_layers") or 0)
    if out.get("layer_types") is None:
        # Gated DeltaNet everywhere but every 4th layer (at least the last one is attention).
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if n and "full_attention" not in types:
            types[-1] = "full_attention"
        out["layer_types"] = types
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        out[name] = out.get(name) or heads
    out["linear_key_head_dim"] = out.get("linear_key_head_dim") or int(
        0.75 * int(cfg.get("hidden_size") or 0) / int(out["linear_num_key_heads"]))
    out["linear_value_head_dim"] = out.get("linear_value_head_dim") or \
        2 * int(out["linear_key_head_dim"])
    return out


# dots3_note's layer types: MLA with a lightning indexer choosing its top-k entries, plain
# MLA (configs with use_dsa off), MLA over a sliding window.
_DOTS3_KINDS = {"indexed_attention": (MLA, INDEXER), "full_attention": (MLA,),
                "sliding_attention": (MLA_SLIDING,)}
# What transformers gives dots3_note's sliding layers when a config has no per_layer_config
# (released configs spell them swa_*).
_DOTS3_SWA_DEFAULTS = {"num_attention_heads": 64, "num_key_value_heads": 64,
                       "q_lora_rank": 1024, "kv_lora_rank": 1024, "head_dim": 256,
                       "qk_nope_head_dim": 192, "v_head_dim": 128}


def dots3_defaults(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """dots3_note's text config as transformers completes it: `layer_types` (indexed
    layers 0, 1 and every 4th from 1, sliding elsewhere; `use_dsa` false: plain MLA) and
    the sliding layers' own MLA sizes in `per_layer_config` (from swa_* or the defaults)."""
    out = dict(cfg)
    n = int(cfg["num_hidden_layers"])
    use_dsa = cfg.get("use_dsa", None if "per_layer_config" in cfg else True)
    full = "full_attention" if use_dsa is False else "indexed_attention"
    if out.get("layer_types") is None:
        slides = cfg.get("use_sliding_window", True)
        out["layer_types"] = [full if not slides or i < 2 or i % 4 == 1
                              else "sliding_attention" for i in range(n)]
    if use_dsa is not None:
        other = "full_attention" if full == "indexed_attention" else "indexed_attention"
        out["layer_types"] = [full if t == other else t for t in out["layer_types"]]
    for word in out["layer_types"]:
        if word not in _DOTS3_KINDS:
            raise ValueError(f"layer_types: unknown dots3_note layer type {word!r}; "
                             f"accepted: {', '.join(_DOTS3_KINDS)}")
    if out.get("per_layer_config") is None:
        swa = {k: cfg.get(f"swa_{k}", v) for k, v in _DOTS3_SWA_DEFAULTS.items()}
        swa["qk_rope_head_dim"] = cfg.get("swa_qk_rope_head_dim",
                                          swa["head_dim"] - swa["qk_nope_head_dim"])
        out["per_layer_config"] = {str(i): swa for i, t in enumerate(out["layer_types"])
                                   if t == "sliding_attention"}
    if out.get("sliding_window") is None:
        out["sliding_window"] = cfg.get("sliding_window_size", 512)
    return out


def inkling_defaults(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Inkling's text config as transformers completes it: `sliding_window` from
    `sliding_window_size`, and `layer_types` (sliding but every 6th layer, or Inkling's
    `local_layer_ids` sliding)."""
    out = dict(cfg)
    out["sliding_window"] = out.get("sliding_window_size") or out.get("sliding_window") or 512
    if out.get("layer_types") is None:
        n = int(cfg["num_hidden_layers"])
        local = cfg.get("local_layer_ids")
        sliding = set(local) if local is not None else {i for i in range(n) if (i + 1) % 6}
        out["layer_types"] = ["hybrid_sliding" if i in sliding else "hybrid" for i in range(n)]
    for word in out["layer_types"]:
        if word not in ("hybrid", "hybrid_sliding"):
            raise ValueError(f"layer_types: unknown {cfg['model_type']} layer type {word!r}; "
                             f"accepted: hybrid, hybrid_sliding")
    return out


def qwen4_layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """Qwen4-Exp's layers: Gated DeltaNet ("linear_attention") or attention over its QSA
    indexer's choice ("indexed_attention"; released configs call it "full_attention"),
    by default the latter every `full_attention_interval` (4) layers."""
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval") or 4)
    words = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(n)]
    out = ["indexed_attention" if w == "full_attention" else str(w) for w in words]
    for word in out:
        if word not in ("linear_attention", "indexed_attention"):
            raise ValueError(f"layer_types: unknown qwen4_exp layer type {word!r}; accepted: "
                             f"linear_attention, indexed_attention, full_attention")
    return out


# DeepSeek-V4's layer types and the parts of each that hold KV cache; `compress_ratios`
# (released configs, one entry per layer then the MTP layer's) spells them 0 / 4 / 128.
_V4_KINDS = {"sliding_attention": (V4_SLIDING,),
             "compressed_sparse_attention": (V4_SLIDING, CSA, CSA_INDEXER, CSA_STATE),
             "heavily_compressed_attention": (V4_SLIDING, HCA, HCA_STATE)}
_V4_RATIO_WORDS = {0: "sliding_attention", 4: "compressed_sparse_attention",
                   128: "heavily_compressed_attention"}
_V4_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def deepseek_v4_layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """DeepSeek-V4's layer types as transformers reads them: `layer_types`, else
    `compress_ratios` (its first num_hidden_layers entries), else two HCA layers then CSA and
    HCA alternating."""
    n = int(cfg["num_hidden_layers"])
    words = cfg.get("layer_types")
    if words is None and cfg.get("compress_ratios") is not None:
        ratios = list(cfg["compress_ratios"])[:n]
        for r in ratios:
            if r not in _V4_RATIO_WORDS:
                raise ValueError(f"compress_ratios: DeepSeek-V4 layers compress by 0 (sliding "
                                 f"only), 4 (CSA) or 128 (HCA), got {r!r}")
        words = [_V4_RATIO_WORDS[r] for r in ratios]
    if words is None:
        words = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(n - 2, 0))]
    out = [str(w) for w in list(words)[:n]]
    for word in out:
        if word not in _V4_KINDS:
            raise ValueError(f"layer_types: unknown deepseek_v4 layer type {word!r}; "
                             f"accepted: {', '.join(_V4_KINDS)}")
    return out


def deepseek_v4_rates(cfg: Mapping[str, Any]) -> dict[str, int]:
    """Tokens per compressed entry by layer type: `compress_rates`, the older
    compress_rate_csa / compress_rate_hca, else 4 and 128."""
    rates = dict(_V4_DEFAULT_RATES)
    rates.update(cfg.get("compress_rates") or {})
    for key, old in (("compressed_sparse_attention", "compress_rate_csa"),
                     ("heavily_compressed_attention", "compress_rate_hca")):
        if cfg.get(old) is not None:
            rates[key] = cfg[old]
    return {k: int(v) for k, v in rates.items()}


def _v4_spec(kind: str, cfg: Mapping[str, Any], block_size: int, dtype: str) -> KVCacheSpec:
    """One DeepSeek-V4 part: K=V rows of `head_dim` (one KV head) in a sliding window, or
    entries and states whose blocks cover a whole number of windows (lcm with the block)."""
    head = int(cfg.get("head_dim") or 512)
    window = int(cfg.get("sliding_window") or 128)
    if kind == V4_SLIDING:
        return MLASlidingWindowSpec(sliding_window=window, block_size=block_size, dtype=dtype,
                                    num_kv_heads=1, head_size=head)
    rates = deepseek_v4_rates(cfg)
    rate = rates["compressed_sparse_attention" if kind in (CSA, CSA_INDEXER, CSA_STATE)
                 else "heavily_compressed_attention"]
    blocks = math.lcm(block_size, rate)
    if kind in (CSA, HCA):
        return CompressedAttentionSpec(block_size=blocks, head_size=head, compress_rate=rate,
                                       dtype=dtype)
    index_head = int(cfg.get("index_head_dim") or 128)
    if kind == CSA_INDEXER:
        return IndexerKeySpec(block_size=blocks, head_size=index_head, compress_rate=rate,
                              dtype=dtype)
    # The projections of the tokens since the last closed window, [rate - 1, width] for kv
    # and for gate; CSA projects 2 x width per token (two overlapping series) and keeps the
    # last window's first halves, [rate, width] each, for its indexer's compressor too.
    if kind == HCA_STATE:
        shapes: tuple[tuple[int, ...], ...] = ((rate - 1, head),) * 2
        return CompressorStateSpec(block_size=blocks, shapes=shapes, dtypes=(dtype,) * 2,
                                   compress_rate=rate)
    shapes = tuple(shape for width in (head, index_head)
                   for shape in ((rate - 1, 2 * width),) * 2 + ((rate, width),) * 2)
    return CompressorStateSpec(block_size=blocks, shapes=shapes, dtypes=(dtype,) * 8,
                               compress_rate=rate, overlap=True)


def layer_config(cfg: Mapping[str, Any], layer: int) -> Mapping[str, Any]:
    """The config of one layer: `per_layer_config`'s entry for it (keys saved zero-padded,
    "05") over the model's fields."""
    per_layer = cfg.get("per_layer_config")
    if not isinstance(per_layer, Mapping):
        return cfg
    override = next((v for k, v in per_layer.items() if int(k) == layer), None) or {}
    return {**cfg, **override}


def _first(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def layer_kinds(config: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """Per decoder layer, the kinds of its KV-holding parts (`()` for MLP-only layers;
    two parts for Falcon-H1, whose layers run attention and Mamba2 in parallel)."""
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    listed = cfg.get("layers_block_type") or cfg.get("layer_types") or []
    # transformers 5.x saves some hybrids (NemotronH) with the list only.
    n = int(cfg.get("num_hidden_layers") or len(listed))
    if model_type == "falcon_h1":
        return [(FULL, MAMBA)] * n
    if model_type == "rwkv":
        return [(RWKV,)] * n
    if model_type == "xlstm":
        return [(MLSTM,)] * int(cfg.get("num_hidden_layers") or cfg.get("num_blocks") or 0)
    if model_type in ATTENTION_FREE:
        return [(MAMBA if model_type == "mamba2" else MAMBA1,)] * n
    if model_type in KDA_MLA_TYPES:
        return [(KDA,) if k == LINEAR else (MLA,) for k in _kda_mla_kinds(cfg, model_type, n)]
    if model_type == "recurrent_gemma":
        # `block_types` repeats over the layers: recurrent blocks and local attention.
        blocks = list(cfg.get("block_types") or ("recurrent", "recurrent", "attention"))
        return [(RG_LRU if blocks[i % len(blocks)] == "recurrent" else SLIDING,)
                for i in range(n)]
    if model_type in ("zamba", "zamba2"):
        return _zamba_kinds(cfg, model_type, n)
    if model_type == "zaya":
        return _zaya_kinds(cfg, n)
    if model_type in INKLING_TYPES:
        return [(SLIDING if w == "hybrid_sliding" else FULL, SCONV) for w in cfg["layer_types"]]
    if model_type == "dots3_note_text":
        return [_DOTS3_KINDS[w] for w in cfg["layer_types"]]
    if model_type == "deepseek_v4":
        return [_V4_KINDS[w] for w in deepseek_v4_layer_types(cfg)]
    if model_type == "qwen4_exp_text":
        # Its attention layers keep indexer keys where the config sets the indexer up
        # (`indexer_n_heads`: "setting this enables QSA").
        attention = (FULL, INDEXER) if cfg.get("indexer_n_heads") else (FULL,)
        return [(LINEAR,) if w == "linear_attention" else attention
                for w in qwen4_layer_types(cfg)]
    kinds = _attention_kinds(cfg, model_type, n)
    if model_type == "minimax":  # its linear attention is lightning attention
        kinds = [LIGHTNING if k == LINEAR else k for k in kinds]
    if not cfg.get("linear_num_key_heads"):
        # transformers 5.x saves Mamba layers as "linear_attention"; only configs with Gated
        # DeltaNet fields (Qwen3-Next) mean a linear-attention state by it.
        kinds = [MAMBA if k == LINEAR else k for k in kinds]
    return [() if k == NONE else (MAMBA1 if k == MAMBA and model_type == "jamba" else k,)
            for k in kinds]


def _zamba_kinds(cfg: Mapping[str, Any], model_type: str, n: int) -> list[tuple[str, ...]]:
    """Zamba / Zamba2: Mamba layers (Mamba1 / Mamba2); "hybrid" ones also run the shared
    attention block, with a KV cache of their own per layer. Zamba configs without the list
    put them at layer 2 and every `attn_layer_period` from `attn_layer_offset + 3`, as
    transformers does."""
    mamba = MAMBA if model_type == "zamba2" else MAMBA1
    words = cfg.get("layers_block_type")
    if words is None and model_type == "zamba":
        period, offset = int(cfg.get("attn_layer_period", 6)), int(cfg.get("attn_layer_offset", 4))
        words = ["mamba", "mamba", "hybrid"] + [
            "hybrid" if i % period == offset else "mamba" for i in range(n - 3)]
    if not isinstance(words, list):
        raise ValueError(f"{model_type}: layers_block_type (a list of 'mamba' / 'hybrid' per "
                         f"layer) is missing")
    kinds: list[tuple[str, ...]] = []
    for word in words:
        if word == "hybrid":
            kinds.append((FULL, mamba))
        elif word in ("mamba", "mamba2", "linear_attention"):
            kinds.append((mamba,))
        else:
            raise ValueError(f"layers_block_type: unknown {model_type} layer type {word!r}; "
                             f"accepted: hybrid, mamba, linear_attention")
    return kinds


def _zaya_kinds(cfg: Mapping[str, Any], n: int) -> list[tuple[str, ...]]:
    """Zaya: every layer is attention ("hybrid": full, "hybrid_sliding": sliding) whose q/k
    convolutions and delayed values keep a state beside the KV cache."""
    kinds: list[tuple[str, ...]] = []
    for word in cfg.get("layer_types") or ["hybrid"] * n:
        if word not in ("hybrid", "hybrid_sliding"):
            raise ValueError(f"layer_types: unknown zaya layer type {word!r}; accepted: "
                             f"hybrid, hybrid_sliding")
        kinds.append((SLIDING if word == "hybrid_sliding" else FULL, CCA))
    return kinds


def _kda_mla_kinds(cfg: Mapping[str, Any], model_type: str, n: int) -> list[str]:
    """Kimi Linear / Ling 3.0: `layer_types`, else Kimi's released configs list the MLA
    layers 1-indexed in `linear_attn_config.full_attn_layers`, else the family's default
    (Kimi: every 4th layer from layer 4; Ling: the last of every `layer_group_size`)."""
    if isinstance(cfg.get("layer_types"), list):
        return [_word(w, "layer_types") for w in cfg["layer_types"]]
    linear = cfg.get("linear_attn_config") or {}
    if isinstance(linear.get("full_attn_layers"), list):
        full = {int(i) - 1 for i in linear["full_attn_layers"]}
        return [FULL if i in full else LINEAR for i in range(n)]
    if model_type == "kimi_linear":
        return [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]
    group = int(cfg.get("layer_group_size") or 6)
    return [FULL if (i + 1) % group == 0 else LINEAR for i in range(n)]


def kda_shape(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    """(heads, head size, conv kernel) of KDA layers: saved by transformers as `linear_*`,
    by Kimi's released configs in `linear_attn_config`, by Ling's as the attention fields."""
    linear = cfg.get("linear_attn_config") or {}
    heads = _first(cfg, "linear_num_heads", default=linear.get("num_heads")
                   or cfg.get("num_attention_heads"))
    head_dim = _first(cfg, "linear_head_dim", default=linear.get("head_dim")
                      or cfg.get("head_dim"))
    kernel = _first(cfg, "linear_conv_kernel_dim", default=linear.get("short_conv_kernel_size")
                    or cfg.get("short_conv_kernel_size") or 4)
    return int(heads), int(head_dim), int(kernel)


def _attention_kinds(cfg: Mapping[str, Any], model_type: str, n: int) -> list[str]:
    if isinstance(cfg.get("layer_types"), list):
        return [_word(w, "layer_types") for w in cfg["layer_types"]]
    if cfg.get("hybrid_override_pattern"):
        pattern = str(cfg["hybrid_override_pattern"])
        if any(c not in _PATTERN_CHARS for c in pattern):
            raise ValueError(f"hybrid_override_pattern {pattern!r}: accepted characters are "
                             f"{''.join(_PATTERN_CHARS)}")
        return [_PATTERN_CHARS[c] for c in pattern]
    if isinstance(cfg.get("layers_block_type"), list):
        return [_word(w, "layers_block_type") for w in cfg["layers_block_type"]]
    if cfg.get("attn_layer_period"):
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        return [FULL if i % period == offset else MAMBA for i in range(n)]
    if isinstance(cfg.get("full_attn_idxs"), list):  # LFM2 configs without layer_types
        indices = set(cfg["full_attn_idxs"])
        return [FULL if i in indices else CONV for i in range(n)]
    if isinstance(cfg.get("attn_layer_indices"), list):
        indices = set(cfg["attn_layer_indices"])
        return [FULL if i in indices else MAMBA for i in range(n)]
    if cfg.get("full_attention_interval"):
        interval = int(cfg["full_attention_interval"])
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if cfg.get("attention_chunk_size"):
        # Llama 4: RoPE layers use chunked attention, NoPE layers (flag 0) attend globally.
        flags = cfg.get("no_rope_layers") or [
            int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0) for i in range(n)]
        return [CHUNKED if flag else FULL for flag in flags]
    if cfg.get("sliding_window") is None:
        return [FULL] * n
    pattern = _first(cfg, "sliding_window_pattern", "_sliding_window_pattern")
    if model_type.startswith("gemma3") and pattern is None:
        pattern = 6  # transformers' Gemma 3 default: every 6th layer is global
    if pattern is None and model_type in _FULL_LAYER_DEFAULTS:
        # Configs saved without `layer_types`: the family's default, as transformers builds it.
        is_full = _FULL_LAYER_DEFAULTS[model_type]
        return [FULL if is_full(cfg, i) else SLIDING for i in range(n)]
    if isinstance(pattern, str):
        # EXAONE 4 may spell it in letters repeated over the layers: "LLLG" = 3 local
        # (sliding) layers, then a global one.
        if not pattern or set(pattern.upper()) - {"L", "G"}:
            raise ValueError(f"sliding_window_pattern {pattern!r}: give a layer count or "
                             f"letters L (sliding) / G (full), e.g. 'LLLG'")
        return [SLIDING if pattern[i % len(pattern)].upper() == "L" else FULL
                for i in range(n)]
    if pattern:
        return [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(n)]
    if model_type == "gemma2":
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    if model_type in _QWEN_WINDOWS:
        if not cfg.get("use_sliding_window"):
            return [FULL] * n
        slides = _QWEN_WINDOWS[model_type]
        # transformers' default when the config leaves max_window_layers out.
        bound = int(_first(cfg, "max_window_layers", default=28))
        return [SLIDING if slides(i, bound) else FULL for i in range(n)]
    return [SLIDING] * n


# Qwen families with `use_sliding_window` on: (layer, max_window_layers) -> whether the layer
# slides, as their transformers configs build `layer_types`. Qwen2/Qwen3 keep the bottom layers
# full; Qwen2-MoE slides the even layers *below* the bound; Qwen3-MoE's attention slides on
# every layer and never reads max_window_layers.
_QWEN_WINDOWS: dict[str, Any] = {
    "qwen2": lambda i, bound: i >= bound, "qwen3": lambda i, bound: i >= bound,
    "qwen2_moe": lambda i, bound: i % 2 == 0 and i < bound,
    "qwen3_moe": lambda i, bound: True,
}


# model_type -> (text config, layer) -> whether the layer is full attention, for configs with a
# `sliding_window` but neither `layer_types` nor `sliding_window_pattern`.
_FULL_LAYER_DEFAULTS: dict[str, Any] = {
    **{t: (lambda cfg, i: (i + 1) % 4 == 0)
       for t in ("olmo3", "cohere2", "cohere2_moe", "exaone4", "exaone_moe")},
    "vaultgemma": lambda cfg, i: i % 2 == 1,
    "afmoe": lambda cfg, i: (i + 1) % int(cfg.get("global_attn_every_n_layers") or 4) == 0,
    "granite_swa": lambda cfg, i: i % 4 == 0, "granitemoe_swa": lambda cfg, i: i % 4 == 0,
    "mimo_v2_flash": lambda cfg, i: i == 0 or (i + 1) % 6 == 0,
    "dots1": lambda cfg, i: i < int(_first(cfg, "max_window_layers", default=62)),
    "smollm3": lambda cfg, i: _smollm3_full(cfg, i),
    # issue 50's families, as their transformers configs build `layer_types`.
    "cwm": lambda cfg, i: i % 4 == 0,
    "kolibri1": lambda cfg, i: (i + 1) % 5 == 0,
    "flint": lambda cfg, i: i < 2 or i % 4 == 1 or i == int(cfg["num_hidden_layers"]) - 1,
    "beam": lambda cfg, i: (i + 1) % 6 == 0 or i == int(cfg["num_hidden_layers"]) - 1,
    "laguna": lambda cfg, i: True, "mellum": lambda cfg, i: True,
    "modernbert-decoder": lambda cfg, i: i % int(cfg.get("global_attn_every_n_layers")
                                                 or 3) == 0,
}


def _smollm3_full(cfg: Mapping[str, Any], layer: int) -> bool:
    """SmolLM3 slides only where it leaves RoPE out (flag 0), and only with
    use_sliding_window; the flags default to a NoPE layer every `no_rope_layer_interval`."""
    flags = cfg.get("no_rope_layers")
    has_rope = flags[layer] if flags else (layer + 1) % int(
        cfg.get("no_rope_layer_interval") or 4) != 0
    return not cfg.get("use_sliding_window") or bool(has_rope)


def _word(word: object, field: str) -> str:
    try:
        return _LAYER_TYPE_WORDS[str(word).lower()]
    except KeyError:
        raise ValueError(f"{field}: unknown layer type {word!r}; accepted: "
                         f"{', '.join(sorted(_LAYER_TYPE_WORDS))}") from None


def kv_layout_from_config(config: Mapping[str, Any], *, block_size: int = 16,
                          kv_dtype: str | None = None,
                          source: str = "config.json") -> ModelKVLayout:
    """Per-layer KV cache specs of a model (layers reusing another's KV get none).
    `source` names the config in error messages."""
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unknown architecture model_type={model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    check_config(config, source, for_model=False)
    dtype = kv_dtype or str(_first(cfg, "torch_dtype", "dtype", default=None)
                            or _first(config, "torch_dtype", "dtype", default="bfloat16"))
    kinds = layer_kinds(config)
    specs: dict[str, KVCacheSpec] = {}
    for i, parts in enumerate(kinds):
        for kind in parts:
            name = f"model.layers.{i}." + ("mamba" if kind in STATE_KINDS else
                                           "self_attn.indexer" if kind == INDEXER
                                           else _V4_PARTS.get(kind, "self_attn"))
            specs[name] = _v4_spec(kind, cfg, block_size, dtype) if kind in _V4_PARTS \
                else _spec_for(kind, cfg, block_size, dtype, i, model_type)
    return ModelKVLayout(
        model_type=model_type, layer_specs=specs, kv_sharing=_kv_sharing(cfg, kinds),
        layer_kinds=tuple(kinds),
        max_position_embeddings=_first(cfg, "max_position_embeddings", "model_max_length"))


_V4_PARTS = {V4_SLIDING: "self_attn", CSA: "self_attn.compressor",
             HCA: "self_attn.compressor", CSA_INDEXER: "self_attn.indexer",
             CSA_STATE: "self_attn.compressor_state", HCA_STATE: "self_attn.compressor_state"}


def _kv_sharing(cfg: Mapping[str, Any], kinds: list[tuple[str, ...]]) -> dict[str, str]:
    return {f"model.layers.{i}.self_attn": f"model.layers.{t}.self_attn"
            for i, t in kv_sharing_targets(cfg, kinds).items()}


def kv_sharing_targets(config: Mapping[str, Any],
                       kinds: list[tuple[str, ...]] | None = None) -> dict[int, int]:
    """Layer index -> index of the layer whose KV cache it reads, from either
    - `num_kv_shared_layers` (Gemma 3n / Gemma 4): the last N layers read the KV of the last
      earlier layer of the same attention kind; or
    - `kv_sharing_target_layers`, a map {layer: target layer} for any other architecture
      (YOCO-style models: later layers reuse an earlier layer's KV)."""
    cfg = _text_config(config)
    kinds = layer_kinds(config) if kinds is None else kinds
    num_shared = int(cfg.get("num_kv_shared_layers") or 0)
    explicit = cfg.get("kv_sharing_target_layers")
    if num_shared and explicit:
        raise ValueError("give either num_kv_shared_layers or kv_sharing_target_layers, "
                         "not both")
    if explicit:
        return _explicit_kv_sharing(explicit, kinds)
    if not 0 <= num_shared < len(kinds):
        raise ValueError(f"num_kv_shared_layers={num_shared} must be in [0, {len(kinds)})")
    first_shared = len(kinds) - num_shared
    sharing: dict[int, int] = {}
    for i in range(first_shared, len(kinds)):
        for kind in kinds[i]:
            owners = [j for j in range(first_shared) if kind in kinds[j]]
            if not owners:
                raise ValueError(f"layer {i} shares KV but no earlier layer is {kind}")
            sharing[i] = owners[-1]
    return sharing


def _explicit_kv_sharing(explicit: object, kinds: list[tuple[str, ...]]) -> dict[int, int]:
    if not isinstance(explicit, Mapping):
        raise ValueError(f"kv_sharing_target_layers must map layer index -> target layer "
                         f"index, e.g. {{\"3\": 1}}; got {explicit!r}")
    sharing: dict[int, int] = {}
    for key, value in explicit.items():
        try:
            layer, target = int(key), int(value)
        except (TypeError, ValueError):
            raise ValueError(f"kv_sharing_target_layers: {key!r}: {value!r} is not a pair of "
                             f"layer indices") from None
        if not 0 <= target < layer < len(kinds):
            raise ValueError(f"kv_sharing_target_layers: layer {layer} -> {target}: a layer "
                             f"may read only an earlier layer's KV (layers 0..{len(kinds) - 1})")
        if kinds[layer] != kinds[target] or not kinds[layer] or \
                any(k in STATE_KINDS for k in kinds[layer]):
            raise ValueError(f"kv_sharing_target_layers: layer {layer} ({'/'.join(kinds[layer])}"
                             f") cannot read layer {target} ({'/'.join(kinds[target])}): both "
                             f"must be attention layers of the same kind")
        sharing[layer] = target
    return sharing


def kv_shared_from(targets: Mapping[int, int], num_layers: int) -> int | None:
    """The first layer of the trailing run of layers that only read shared KV: from there on
    no layer writes KV (where KV-sharing fast prefill can start), or None."""
    first = num_layers
    while first > 0 and first - 1 in targets:
        first -= 1
    return first if first < num_layers else None


def attention_shape(cfg: Mapping[str, Any], layer: int, kind: str) -> tuple[int, int]:
    """(KV heads, head size) of an attention layer. Gemma 4 gives full-attention layers their
    own (`per_layer_config`, or `global_head_dim` / `num_global_key_value_heads`)."""
    heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(_first(cfg, "num_key_value_heads", default=heads))
    head_size = int(_first(cfg, "head_dim", default=int(cfg["hidden_size"]) // heads))
    per_layer = cfg.get("per_layer_config")
    if isinstance(per_layer, Mapping):
        # transformers saves the keys zero-padded to the widest index ("05" of 30 layers).
        override = next((v for k, v in per_layer.items() if int(k) == layer), None) or {}
        return (int(override.get("num_key_value_heads", num_kv_heads)),
                int(override.get("head_dim", head_size)))
    if cfg.get("model_type") == "mimo_v2_flash":
        # Sliding layers have twice the KV heads; values (v_head_dim) are stored padded to
        # the key head size (one head size per page).
        return ((2 if kind == SLIDING else 1) * num_kv_heads,
                max(head_size, int(cfg.get("v_head_dim") or head_size)))
    if cfg.get("model_type") in INKLING_TYPES and kind == SLIDING:
        return int(cfg["swa_num_key_value_heads"]), int(cfg["swa_head_dim"])
    if cfg.get("model_type") == "doge":
        # One more key channel per head for the key's bias (layers/key_bias_attention.py).
        return num_kv_heads, head_size + 1
    if cfg.get("model_type") == "modernbert-decoder":
        # K/V heads as many as query heads, of hidden / heads (head fields are not read).
        return heads, int(cfg["hidden_size"]) // heads
    if cfg.get("model_type") in ("zamba", "zamba2"):
        # The shared block attends over [h | embedding]: heads of 2 x hidden / heads.
        return num_kv_heads, int(_first(cfg, "attention_head_dim",
                                        default=2 * int(cfg["hidden_size"]) // heads))
    if str(cfg.get("model_type", "")).startswith("gemma4") and kind == FULL:
        # transformers' Gemma 4 defaults, applied when per_layer_config is not saved.
        if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads"):
            num_kv_heads = int(cfg["num_global_key_value_heads"])
        return num_kv_heads, int(cfg.get("global_head_dim") or 512)
    return num_kv_heads, head_size


def values_are_keys(cfg: Mapping[str, Any], model_type: str, kind: str) -> bool:
    """Whether a layer's values come from its key projection (Gemma 4's full layers with
    `attention_k_eq_v`: V = v_norm(raw), K = RoPE(k_norm(raw))): its page then holds the raw
    keys alone (a K-only page) and the layer derives K and V from them."""
    return model_type.startswith("gemma4") and kind == FULL and \
        bool(cfg.get("attention_k_eq_v", False))


def _spec_for(kind: str, cfg: Mapping[str, Any], block_size: int, dtype: str,
              layer: int, model_type: str) -> KVCacheSpec:
    hidden = int(cfg["hidden_size"])
    if kind in (FULL, SLIDING, CHUNKED):
        num_kv_heads, head_size = attention_shape(cfg, layer, kind)
        attn = dict(block_size=block_size, dtype=dtype, num_kv_heads=num_kv_heads,
                    head_size=head_size, keys_only=values_are_keys(cfg, model_type, kind))
        if kind == SLIDING:
            window = _first(cfg, "sliding_window", "attention_window_size")  # RecurrentGemma
            return SlidingWindowSpec(sliding_window=int(window), **attn)
        if kind == CHUNKED:
            return ChunkedLocalAttentionSpec(
                attention_chunk_size=int(cfg["attention_chunk_size"]), **attn)
        return FullAttentionSpec(**attn)
    if kind in (MLA, MLA_SLIDING):
        # One latent per token: the normalised c_kv and the roped key part, no V.
        mla = layer_config(cfg, layer)
        width = int(mla["kv_lora_rank"]) + int(mla["qk_rope_head_dim"])
        if kind == MLA_SLIDING:
            return MLASlidingWindowSpec(sliding_window=int(mla["sliding_window"]),
                                        block_size=block_size, dtype=dtype, num_kv_heads=1,
                                        head_size=width)
        return MLAAttentionSpec(block_size=block_size, dtype=dtype, num_kv_heads=1,
                                head_size=width)
    if kind == INDEXER:
        # One key per token, in the model's dtype as the references keep it (Qwen4-Exp's
        # raw keys, which its indexer averages per `indexer_compress_ratio` tokens at
        # each read).
        return IndexerKeySpec(block_size=block_size, dtype=dtype, head_size=int(
            _first(cfg, "index_head_dim", "indexer_head_dim")))
    if kind == KDA:
        # The conv's last inputs over [q, k, v] and the state, float32 as the reference keeps.
        heads, head_dim, kernel = kda_shape(cfg)
        return MambaSpec(block_size=block_size,
                         shapes=((3 * heads * head_dim, kernel - 1), (heads, head_dim, head_dim)),
                         dtypes=(dtype, "float32"))
    if kind == LIGHTNING:
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        return MambaSpec(block_size=block_size, shapes=((heads, head_dim, head_dim),),
                         dtypes=(dtype,))
    if kind == RG_LRU:
        # The conv's last inputs and the recurrence, kept in float32 as the reference does.
        width = int(cfg.get("lru_width") or hidden)
        return MambaSpec(block_size=block_size,
                         shapes=((width, int(cfg.get("conv1d_width", 4)) - 1), (width,)),
                         dtypes=(dtype, "float32"))
    if kind == RWKV:
        # The last inputs of time and channel mixing; the WKV numerator, denominator and
        # running max, in float32 as the reference keeps them.
        return MambaSpec(block_size=block_size,
                         shapes=((2, hidden), (3, int(cfg["attention_hidden_size"]))),
                         dtypes=(dtype, "float32"))
    if kind == MLSTM:
        # Per head the memory C [qk_head, v_head] and the normaliser n [qk_head] with the
        # max exponent m beside it, in `inference_state_dtype` (float32 by default).
        width = int(cfg.get("hidden_size") or cfg["embedding_dim"])
        heads = int(cfg.get("num_heads", 8))
        dk = int(width * float(cfg.get("qk_dim_factor", 0.5))) // heads
        dv = int(width * float(cfg.get("v_dim_factor", 1.0))) // heads
        state = str(cfg.get("inference_state_dtype") or "float32")
        return MambaSpec(block_size=block_size, shapes=((heads, dk, dv), (heads, dk + 1)),
                         dtypes=(state, state))
    if kind == CCA:
        # The q/k convolutions' last (cca_time0 - 1) + (cca_time1 - 1) inputs over [q | k],
        # and the previous token's delayed half of the values.
        heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kernel = int(cfg.get("cca_time0", 2)) + int(cfg.get("cca_time1", 2)) - 2
        return MambaSpec(block_size=block_size,
                         shapes=(((heads + kv_heads) * head_dim, kernel),
                                 (kv_heads * head_dim // 2,)), dtypes=(dtype, dtype))
    if kind == SCONV:
        # The last kernel - 1 inputs of the convs on k and v (the layer's KV width) and on
        # the attention and MLP outputs (hidden), float32 as the reference keeps them.
        kv_heads, head_dim = attention_shape(cfg, layer, SLIDING if cfg["layer_types"][layer]
                                             == "hybrid_sliding" else FULL)
        keep = int(cfg.get("conv_kernel_size") or cfg.get("sconv_kernel_size") or 4) - 1
        kv = kv_heads * head_dim
        return MambaSpec(block_size=block_size,
                         shapes=((kv, keep), (kv, keep), (hidden, keep), (hidden, keep)),
                         dtypes=("float32",) * 4)
    if kind == CONV:
        # The last `conv_L_cache - 1` inputs of a depthwise conv over the hidden channels.
        return MambaSpec(block_size=block_size, shapes=((hidden, int(cfg["conv_L_cache"]) - 1),),
                         dtypes=(dtype,))
    if kind == LINEAR:
        # Gated DeltaNet: conv over [q, k, v] and a [v_heads, k_dim, v_dim] recurrent state.
        nk, dk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
        nv, dv = int(cfg["linear_num_value_heads"]), int(cfg["linear_value_head_dim"])
        conv = int(cfg.get("linear_conv_kernel_dim", 4))
        return MambaSpec(block_size=block_size, shapes=((2 * nk * dk + nv * dv, conv - 1),
                                                        (nv, dk, dv)), dtypes=(dtype, dtype))
    d_state = int(_first(cfg, "mamba_d_state", "ssm_state_size", "state_size", default=16))
    d_conv = int(_first(cfg, "mamba_d_conv", "conv_kernel", default=4))
    expand = int(_first(cfg, "mamba_expand", "expand", default=2))
    if kind == MAMBA1:
        # Pure Mamba saves its inner width (Falcon-Mamba-7B's `expand` disagrees with it).
        saved = cfg.get("intermediate_size") if cfg.get("model_type") in ATTENTION_FREE else None
        d_inner = int(saved) if saved else expand * hidden
        return MambaSpec(block_size=block_size, shapes=((d_inner, d_conv - 1),
                                                        (d_inner, d_state)),
                         dtypes=(dtype, dtype))
    # Pure Mamba2 names its SSM heads plainly (`num_heads`, `head_dim`); hybrids prefix them.
    plain = ("num_heads", "head_dim") if cfg.get("model_type") == "mamba2" else ("", "")
    # Zamba2 spells them n_mamba_heads / mamba_headdim / mamba_ngroups.
    n_heads = int(_first(cfg, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", plain[0]))
    d_head = int(_first(cfg, "mamba_d_head", "mamba_head_dim", "mamba_headdim", plain[1],
                        default=expand * hidden // n_heads))
    n_groups = int(_first(cfg, "mamba_n_groups", "n_groups", "mamba_ngroups", default=1))
    d_inner = int(_first(cfg, "mamba_d_ssm", default=n_heads * d_head))
    # Mamba2: conv over [x, B, C]; SSM state [heads, head_dim, state].
    return MambaSpec(block_size=block_size,
                     shapes=((d_inner + 2 * n_groups * d_state, d_conv - 1),
                             (n_heads, d_head, d_state)),
                     dtypes=(dtype, dtype))
