"""A GGUF file's hyper-parameters as the Hugging Face config the rest of the engine reads.

llama.cpp names an architecture (`general.architecture`, e.g. "gemma3") and keeps its numbers
under that prefix (`gemma3.block_count`, `gemma3.attention.sliding_window`, ...). Each
supported architecture maps to a `model_type` and to the fields its config class would hold,
so the layer mix, the KV planner and the model families run unchanged. What a file cannot say
(Gemma 3's local RoPE base, its layer pattern) is what the family's config class defaults
to. Pure Python: `hybridkv plan model.gguf` needs no torch.

Covered (ARCHS): llama, mistral3, qwen2, qwen3, gemma2, gemma3, smollm3, the MoE families
qwen2moe (dense layers read off the tensors: a layer without a router) and qwen3moe, and the
attention-free state-space models mamba (falcon-mamba when `ssm.dt_b_c_rms`) and mamba2 (the
`ssm.*` keys: conv_kernel, inner_size, state_size, time_step_rank, group_count). Hybrids
whose `attention.head_count_kv` is a per-layer list (0 = recurrent layer) can say so with
`per_layer_kv`. Any other architecture is refused in one line naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from hybridkv.models.gguf_file import GGUFHeader


@dataclass(frozen=True)
class Arch:
    """How one llama.cpp architecture becomes a Hugging Face config."""

    model_type: str
    # Extra config fields, computed from the file's metadata (`get(key)` reads
    # "{arch}.{key}") and the common fields already mapped.
    extra: Callable[[Callable[[str], Any], dict[str, Any]], dict[str, Any]] = \
        field(default=lambda get, cfg: {})
    # llama.cpp's converter permutes the rows of q/k for these (its rotary pairs neighbours,
    # Hugging Face's pairs halves); the loader permutes them back.
    permuted_qk: bool = False
    # Gemma's converter stores norm weights as (1 + w); the loader subtracts the 1.
    norm_shift: float = 0.0
    tie_default: bool = False
    # Config fields read off the file's tensor names (which layers carry experts, biases).
    tensors: Callable[[Collection[str], dict[str, Any]], dict[str, Any]] = \
        field(default=lambda names, cfg: {})
    # `attention.head_count_kv` may be a per-layer list, 0 marking recurrent layers.
    per_layer_kv: bool = False
    # No attention at all (head_count 0): the config carries no head fields.
    attention_free: bool = False


def _gemma2(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    return {"query_pre_attn_scalar": cfg["head_dim"],
            "attn_logit_softcapping": get("attn_logit_softcapping"),
            "final_logit_softcapping": get("final_logit_softcapping"),
            "hidden_activation": "gelu_pytorch_tanh",
            # Gemma 2 alternates sliding and full layers, sliding first.
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(n)]}


def _gemma3(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    # Five sliding layers then one full, as Gemma 3's config class sets; the file has no
    # key for it. The local base is Gemma 3's fixed 10,000.
    full_theta = cfg["rope_parameters"]["rope_theta"]
    full = dict(cfg["rope_parameters"])
    return {"query_pre_attn_scalar": cfg["head_dim"],
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": get("final_logit_softcapping"),
            "attn_logit_softcapping": get("attn_logit_softcapping"),
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                            for i in range(n)],
            "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0},
                                "full_attention": {**full, "rope_theta": full_theta}}}


def _qwen_window(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    return {"use_sliding_window": False}


def _moe(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"num_experts": get("expert_count"),
                           "num_experts_per_tok": get("expert_used_count"),
                           "moe_intermediate_size": get("expert_feed_forward_length"),
                           "norm_topk_prob": True, "use_sliding_window": False}
    shared = get("expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = shared
    return out


def _qwen2moe(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's qwen2moe does not renormalise the top-k weights (as Qwen2-MoE's default).
    return {**_moe(get, cfg), "norm_topk_prob": False, "decoder_sparse_step": 1}


def _dense_layers(names: Collection[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Layers without a router are dense MLPs (Qwen2-MoE's `mlp_only_layers`)."""
    return {"mlp_only_layers": [i for i in range(cfg["num_hidden_layers"])
                                if f"blk.{i}.ffn_gate_inp.weight" not in names]}


def _mamba(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    inner = get("ssm.inner_size")
    return {"model_type": "falcon_mamba" if get("ssm.dt_b_c_rms") else "mamba",
            "state_size": get("ssm.state_size"), "conv_kernel": get("ssm.conv_kernel"),
            "intermediate_size": inner, "time_step_rank": get("ssm.time_step_rank"),
            "expand": inner // cfg["hidden_size"], "layer_norm_epsilon": cfg["rms_norm_eps"]}


def _mamba2(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    inner, heads = get("ssm.inner_size"), get("ssm.time_step_rank")
    if inner % cfg["hidden_size"]:
        raise ValueError(f"mamba2.ssm.inner_size {inner} is not a multiple of the embedding "
                         f"length {cfg['hidden_size']}; not supported")
    return {"state_size": get("ssm.state_size"), "conv_kernel": get("ssm.conv_kernel"),
            "num_heads": heads, "head_dim": inner // heads, "n_groups": get("ssm.group_count"),
            "expand": inner // cfg["hidden_size"], "intermediate_size": inner,
            "layer_norm_epsilon": cfg["rms_norm_eps"]}


def _ssm_biases(names: Collection[str], cfg: dict[str, Any]) -> dict[str, Any]:
    return {"use_bias": "blk.0.ssm_in.bias" in names,
            "use_conv_bias": "blk.0.ssm_conv1d.bias" in names}


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", permuted_qk=True),
    "mistral3": Arch("ministral3", permuted_qk=True),
    "qwen2": Arch("qwen2", _qwen_window),
    "qwen3": Arch("qwen3", _qwen_window),
    "qwen2moe": Arch("qwen2_moe", _qwen2moe, tensors=_dense_layers),
    "qwen3moe": Arch("qwen3_moe", _moe),
    "mamba": Arch("mamba", _mamba, tensors=_ssm_biases, attention_free=True),
    "mamba2": Arch("mamba2", _mamba2, tensors=_ssm_biases, attention_free=True),
    "gemma2": Arch("gemma2", _gemma2, norm_shift=1.0, tie_default=True),
    "gemma3": Arch("gemma3_text", _gemma3, norm_shift=1.0, tie_default=True),
    "smollm3": Arch("smollm3", tie_default=True),
}


def _gguf_get(header: GGUFHeader, arch: str) -> Callable[[str], Any]:
    return lambda key: header.metadata.get(f"{arch}.{key}")


def _int(header: GGUFHeader, key: str, value: Any) -> int:
    if isinstance(value, list):  # per-layer lists: the engine's families take one value
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{header.path}: {key} differs across layers ({value[:8]}...); "
                             f"per-layer values are not supported for this architecture")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{header.path}: metadata {key} must be a non-negative integer, got "
                         f"{value!r}")
    return value


def _float(header: GGUFHeader, key: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{header.path}: metadata {key} must be a number, got {value!r}")
    return float(value)


def config_from_gguf(header: GGUFHeader) -> dict[str, Any]:
    """The Hugging Face config (a dict, as config.json would hold it) of a GGUF model."""
    arch_name = header.architecture
    arch = ARCHS.get(arch_name)
    if arch is None:
        raise ValueError(f"{header.path}: GGUF architecture {arch_name!r} is not supported; "
                         f"supported: {', '.join(sorted(ARCHS))}")
    meta = header.metadata
    get = _gguf_get(header, arch_name)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ValueError(f"{header.path}: metadata {arch_name}.{key} is missing")
        return value

    layers = _int(header, f"{arch_name}.block_count", need("block_count"))
    hidden = _int(header, f"{arch_name}.embedding_length", need("embedding_length"))
    heads = _int(header, f"{arch_name}.attention.head_count", need("attention.head_count"))
    kv_value = get("attention.head_count_kv") or heads
    if arch.per_layer_kv and isinstance(kv_value, list):
        # Hybrids: 0 marks a recurrent layer; the attention layers share one count.
        kv_value = [v for v in kv_value if v] or [heads]
    kv_heads = _int(header, f"{arch_name}.attention.head_count_kv", kv_value)
    if heads == 0 and not arch.attention_free:
        raise ValueError(f"{header.path}: metadata {arch_name}.attention.head_count is 0")
    head_dim = _int(header, f"{arch_name}.attention.key_length",
                    get("attention.key_length") or hidden // max(heads, 1))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    if vocab is None:
        raise ValueError(f"{header.path}: neither {arch_name}.vocab_size nor "
                         f"tokenizer.ggml.tokens says the vocabulary size")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _float(
        header, f"{arch_name}.rope.freq_base", get("rope.freq_base") or 10000.0)}
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=_float(
            header, f"{arch_name}.rope.scaling.factor", need("rope.scaling.factor")))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = _int(
                header, f"{arch_name}.rope.scaling.original_context_length",
                need("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise ValueError(f"{header.path}: {arch_name}.rope.scaling.type {scaling!r} is not "
                         f"supported (none, linear, yarn)")
    cfg: dict[str, Any] = {
        "model_type": arch.model_type,
        "architectures": [f"gguf:{arch_name}"],
        "num_hidden_layers": layers, "hidden_size": hidden,
        "intermediate_size": _int(header, f"{arch_name}.feed_forward_length",
                                  get("feed_forward_length") or 0),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": _float(header, f"{arch_name}.attention.layer_norm_rms_epsilon",
                               get("attention.layer_norm_rms_epsilon") or 1e-6),
        "max_position_embeddings": _int(header, f"{arch_name}.context_length",
                                        get("context_length") or 8192),
        "vocab_size": _int(header, f"{arch_name}.vocab_size", vocab),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in header.tensors,
        # GGUF weights are computed on as float32 activations; the KV cache follows.
        "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    rotary_dims = get("rope.dimension_count")
    if rotary_dims is not None and rotary_dims != head_dim:
        cfg["partial_rotary_factor"] = _int(header, f"{arch_name}.rope.dimension_count",
                                            rotary_dims) / head_dim
    window = get("attention.sliding_window")
    if window:
        cfg["sliding_window"] = _int(header, f"{arch_name}.attention.sliding_window", window)
    if any(name.endswith("attn_q.bias") for name in header.tensors):
        cfg["attention_bias"] = True
    if arch.attention_free:
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
            del cfg[key]
    cfg.update({k: v for k, v in arch.extra(get, cfg).items() if v is not None})
    cfg.update(arch.tensors(header.tensors.keys(), cfg))
    return cfg
