"""A GGUF file's hyper-parameters as the Hugging Face config the rest of the engine reads.

llama.cpp names an architecture (`general.architecture`, e.g. "gemma3") and keeps its numbers
under that prefix (`gemma3.block_count`, `gemma3.attention.sliding_window`, ...). Each
supported architecture maps to a `model_type` and to the fields its config class would hold,
so the layer mix, the KV planner and the model families run unchanged. What a file cannot say
(Gemma 3's local RoPE base, its layer pattern) is what the family's config class defaults
to. Pure Python: `hybridkv plan model.gguf` needs no torch.

Covered (ARCHS): llama (Mistral files use it too), qwen2, qwen3, gemma2, gemma3, the MoE families
qwen2moe (dense layers read off the tensors: a layer without a router) and qwen3moe, and the
attention-free state-space models mamba (falcon-mamba when `ssm.dt_b_c_rms`) and mamba2 (the
`ssm.*` keys: conv_kernel, inner_size, state_size, time_step_rank, group_count), phi3,
starcoder2, and the hybrids, whose `attention.head_count_kv` is a per-layer list (0 = not an
attention layer, `per_layer_kv`) that gives their layer mix: lfm2 (short convolutions),
nemotron_h (Mamba-2 / attention / relu² MLP layers, the MLP ones where the per-layer
`feed_forward_length` is > 0), granitehybrid (Mamba-2 or attention, then experts and a shared
MLP; Granite's scales as its µP multipliers), jamba (Mamba-1 or attention; experts on the
layers with a router) and falcon-h1 (attention and Mamba-2 in parallel, its multipliers
already folded into the weights by the converter), lfm2moe (LFM2's layers, sigmoid-routed
experts after the leading dense ones), qwen3next / qwen35 / qwen35moe (Gated DeltaNet where
`attention.recurrent_layers` says; the `nextn` MTP layers after the model's own are not
counted), and the attention models smollm3 (NoPE every 4th layer, as llama.cpp fixes it),
exaone4 and olmo2 (OLMo 2 and 3; the sliding pattern as layer types), and gemma3n / gemma4
(the sliding pattern, shared-KV layers, per-layer inputs; Gemma 3n's AltUp and activation
sparsity; Gemma 4's full layers with their own head size, KV heads and proportional RoPE,
read off rope_freqs, values equal to keys where they have no attn_v, double-width MLPs and
experts). Any other architecture is refused in one line naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from hybridkv.models.formats.gguf_file import GGUFHeader, read_f32_values


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
    # Gemma's converter stores norm weights as (1 + w); the loader subtracts the 1 (but from
    # the tensor-name suffixes in norm_kept, which the converter leaves as they are).
    norm_shift: float = 0.0
    norm_kept: tuple[str, ...] = ()
    tie_default: bool = False
    # Config fields read off the file's tensor names (which layers carry experts, biases).
    tensors: Callable[[Collection[str], dict[str, Any]], dict[str, Any]] = \
        field(default=lambda names, cfg: {})
    # `attention.head_count_kv` may be a per-layer list, 0 marking recurrent layers.
    per_layer_kv: bool = False
    # No attention at all (head_count 0): the config carries no head fields.
    attention_free: bool = False
    # Layers appended after the model's own (multi-token prediction, `nextn`): not counted
    # in num_hidden_layers.
    nextn: Callable[[Callable[[str], Any], dict[str, Any]], int] = \
        field(default=lambda get, cfg: 0)
    # Per-layer `head_count_kv` / `feed_forward_length` lists may differ across layers
    # (Gemma 4's full layers): the common fields take layer 0's, `extra` reads the lists.
    mixed_layers: bool = False
    # Config fields read off tensor shapes or a small tensor's values (the header, the file).
    from_file: Callable[[GGUFHeader, dict[str, Any]], dict[str, Any]] = \
        field(default=lambda header, cfg: {})


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
    return {"use_bias": any(n.endswith(".ssm_in.bias") for n in names),
            "use_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in names)}


def _per_layer(get: Callable[[str], Any], key: str, n: int) -> list[int]:
    value = get(key)
    return list(value) if isinstance(value, list) else [int(value or 0)] * n


def _hybrid_ssm(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The Mamba-2 mixer's fields of a hybrid (names its mixer reads)."""
    inner, heads = get("ssm.inner_size"), get("ssm.time_step_rank")
    return {"mamba_num_heads": heads, "mamba_head_dim": inner // heads,
            "ssm_state_size": get("ssm.state_size"), "n_groups": get("ssm.group_count"),
            "conv_kernel": get("ssm.conv_kernel"), "mamba_d_ssm": inner,
            "layer_norm_epsilon": cfg["rms_norm_eps"], "time_step_limit": [0.0, float("inf")]}


def _nemotron_h(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Layers as llama.cpp tells them: attention where `head_count_kv` > 0, an MLP where
    `feed_forward_length` > 0, Mamba-2 elsewhere."""
    n = cfg["num_hidden_layers"]
    kv = _per_layer(get, "attention.head_count_kv", n)
    ff = _per_layer(get, "feed_forward_length", n)
    return {**_hybrid_ssm(get, cfg), "mlp_hidden_act": "relu2",
            "hybrid_override_pattern": "".join("*" if k else "-" if f else "M"
                                               for k, f in zip(kv, ff, strict=True))}


def _granite_hybrid(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0-H: attention where `head_count_kv` > 0, Mamba-2 elsewhere, each followed
    by the experts and the shared MLP; µP multipliers as Granite's scales; RoPE only where
    the converter set `rope.scaling.finetuned` (NoPE otherwise)."""
    n = cfg["num_hidden_layers"]
    kv = _per_layer(get, "attention.head_count_kv", n)
    return {**_hybrid_ssm(get, cfg),
            "layer_types": ["attention" if k else "mamba" for k in kv],
            "num_local_experts": get("expert_count") or 0,
            "num_experts_per_tok": get("expert_used_count"),
            "intermediate_size": get("expert_feed_forward_length") or cfg["intermediate_size"],
            "shared_intermediate_size": get("expert_shared_feed_forward_length"),
            "attention_multiplier": get("attention.scale"),
            "embedding_multiplier": get("embedding_scale"),
            "residual_multiplier": get("residual_scale"),
            "logits_scaling": get("logit_scale"),
            "position_embedding_type": "rope" if get("rope.scaling.finetuned") else "nope"}


def _period(layers: list[int], n: int, what: str) -> tuple[int, int]:
    """(period, offset) of evenly spaced layers, as Jamba's config states them."""
    if not layers:
        return n + 1, n  # none
    period = layers[1] - layers[0] if len(layers) > 1 else n
    if layers != list(range(layers[0], n, period)):
        raise ValueError(f"jamba: {what} layers {layers} are not evenly spaced; not supported")
    return period, layers[0]


def _jamba(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Mamba-1 where `head_count_kv` is 0, attention elsewhere (no positions)."""
    n = cfg["num_hidden_layers"]
    kv = _per_layer(get, "attention.head_count_kv", n)
    period, offset = _period([i for i, k in enumerate(kv) if k], n, "attention")
    return {"attn_layer_period": period, "attn_layer_offset": offset,
            "mamba_expand": get("ssm.inner_size") // cfg["hidden_size"],
            "mamba_d_state": get("ssm.state_size"), "mamba_d_conv": get("ssm.conv_kernel"),
            "mamba_dt_rank": get("ssm.time_step_rank"),
            "num_experts": get("expert_count") or 1,
            "num_experts_per_tok": get("expert_used_count") or 1}


def _jamba_tensors(names: Collection[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """MoE layers are those with a router; the mixer's biases as the tensors say."""
    n = cfg["num_hidden_layers"]
    period, offset = _period([i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in names],
                             n, "expert")
    return {"expert_layer_period": period, "expert_layer_offset": offset,
            "mamba_proj_bias": any(x.endswith(".ssm_in.bias") for x in names),
            "mamba_conv_bias": any(x.endswith(".ssm_conv1d.bias") for x in names)}


def _falcon_h1(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Attention and Mamba-2 side by side in every layer. llama.cpp's converter folds the
    µP multipliers into the weights (embeddings, head, projections, the in_proj sections),
    so none is left to apply; the Mamba-2 gate comes before its (optional) norm."""
    return {**_hybrid_ssm(get, cfg), "mamba_norm_before_gate": False,
            "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0}


def _falcon_h1_tensors(names: Collection[str], cfg: dict[str, Any]) -> dict[str, Any]:
    return {"mamba_proj_bias": any(x.endswith(".ssm_in.bias") for x in names),
            "projectors_bias": any(x.endswith(".ssm_out.bias") for x in names),
            "mamba_conv_bias": any(x.endswith(".ssm_conv1d.bias") for x in names),
            "mamba_rms_norm": any(x.endswith(".ssm_norm.weight") for x in names),
            "mlp_bias": any(x.endswith(".ffn_up.bias") for x in names)}


def _starcoder2(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    return {"norm_epsilon": get("attention.layer_norm_epsilon"),
            "hidden_act": "gelu_pytorch_tanh"}


def _starcoder2_tensors(names: Collection[str], cfg: dict[str, Any]) -> dict[str, Any]:
    return {"use_bias": any(x.endswith(".attn_q.bias") for x in names)}


def _lfm2(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Attention where `head_count_kv` > 0, short convolutions elsewhere; the file's
    feed_forward_length is the width the model builds (no further adjustment)."""
    kv = _per_layer(get, "attention.head_count_kv", cfg["num_hidden_layers"])
    return {"layer_types": ["full_attention" if k else "conv" for k in kv],
            "conv_L_cache": get("shortconv.l_cache"), "norm_eps": cfg["rms_norm_eps"],
            "block_auto_adjust_ff_dim": False}


def _lfm2_tensors(names: Collection[str], cfg: dict[str, Any]) -> dict[str, Any]:
    return {"conv_bias": any(x.endswith(".shortconv.conv.bias") for x in names)}


def _pattern_types(get: Callable[[str], Any], cfg: dict[str, Any]) -> list[str]:
    """`attention.sliding_window_pattern` (True = sliding) as layer types; all full layers
    where the file has no window."""
    n = cfg["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    if not get("attention.sliding_window") or not isinstance(pattern, list):
        return ["full_attention"] * n
    return ["sliding_attention" if p else "full_attention" for p in pattern[:n]]


def _exaone4(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Post-norms, q/k norms per head; RoPE on the sliding layers only (all layers where
    the file has no window), as both engines read the layer types."""
    return {"layer_types": _pattern_types(get, cfg)}


def _olmo3(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's olmo2 covers OLMo 2 and OLMo 3: OLMo 3's sliding layers (the pattern)
    take their own RoPE base (`rope.freq_base_swa`) without scaling; OLMo 2 is all full
    layers."""
    types = _pattern_types(get, cfg)
    full = dict(cfg["rope_parameters"])
    local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa")
                                                         or full["rope_theta"])}
    return {"layer_types": types,
            "rope_parameters": {"sliding_attention": local, "full_attention": full}}


def _smollm3(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Every 4th layer without RoPE, as llama.cpp's smollm3 fixes it (the file has no list:
    SmolLM3's released `no_rope_layers` is this pattern); no sliding window."""
    n = cfg["num_hidden_layers"]
    return {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n)],
            "use_sliding_window": False}


def _lfm2_moe(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's layers; the first `leading_dense_block_count` with a dense MLP, the others
    sigmoid-routed experts with a selection bias, the top-k weights renormalised (llama.cpp's
    norm_w); a file without `expert_weights_scale` scales them by 1."""
    gating = get("expert_gating_func")
    if gating not in (None, 2):
        raise ValueError(f"lfm2moe: expert_gating_func {gating} is not supported (2, sigmoid)")
    return {**_lfm2(get, cfg), "num_dense_layers": get("leading_dense_block_count") or 0,
            "num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "norm_topk_prob": True, "use_expert_bias": True,
            "routed_scaling_factor": get("expert_weights_scale") or 1.0}


def _gemma_nano(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 3n and Gemma 4 share in the file: the sliding pattern as layer types, a
    RoPE base per layer type, the last `attention.shared_kv_layers` layers reading earlier
    layers' KV, per-layer inputs of `embedding_length_per_layer_input` (0: none)."""
    n = cfg["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) < n:
        raise ValueError(f"attention.sliding_window_pattern must list the {n} layers, got "
                         f"{pattern!r}")
    full = dict(cfg["rope_parameters"])
    local = {"rope_type": "default",
             "rope_theta": float(get("rope.freq_base_swa") or 10000.0)}
    return {"layer_types": ["sliding_attention" if p else "full_attention"
                            for p in pattern[:n]],
            "rope_parameters": {"sliding_attention": local, "full_attention": full},
            "num_kv_shared_layers": int(get("attention.shared_kv_layers") or 0),
            "hidden_size_per_layer_input": int(get("embedding_length_per_layer_input") or 0),
            "final_logit_softcapping": get("final_logit_softcapping"),
            "hidden_activation": "gelu_pytorch_tanh"}


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _gemma3n(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3n: AltUp over `altup.num_inputs` copies; the MLP widths per layer; the
    converter stores each layer's activation sparsity s as the normal quantile it keeps
    above (icdf(s); -inf for a dense layer), turned back into s here."""
    n = cfg["num_hidden_layers"]
    scales = get("activation_sparsity_scale")
    sparsity = [0.0] * n
    if isinstance(scales, list):
        sparsity = [_normal_cdf(float(x)) if x != float("-inf") else 0.0 for x in scales[:n]]
    return {**_gemma_nano(get, cfg),
            "intermediate_size": _per_layer(get, "feed_forward_length", n),
            "altup_num_inputs": int(get("altup.num_inputs") or 4),
            "altup_active_idx": int(get("altup.active_idx") or 0),
            "activation_sparsity_pattern": sparsity}


def _gemma3n_file(header: GGUFHeader, cfg: dict[str, Any]) -> dict[str, Any]:
    """Laurel's rank and the per-layer vocabulary (the converter pads it with zero rows to
    the main one, so tokens past it read zeros, as in llama.cpp) from the tensors' shapes."""
    laurel = header.tensors.get("blk.0.laurel_l.weight")
    per_layer = header.tensors.get("per_layer_token_embd.weight")
    if laurel is None or per_layer is None:
        raise ValueError(f"{header.path}: gemma3n file lacks blk.0.laurel_l.weight or "
                         f"per_layer_token_embd.weight")
    return {"laurel_rank": laurel.shape[0], "vocab_size_per_layer_input": per_layer.shape[0],
            "altup_correct_scale": "blk.0.altup_correct_scale.weight" in header.tensors}


def _gemma4(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4: sliding layers of `key_length_swa`, full layers of `key_length` with their
    own KV heads (the per-layer `head_count_kv`), as `per_layer_config`; the layers that
    read shared KV with MLPs twice as wide where `feed_forward_length` says; experts beside
    the MLP where `expert_count` is set; RoPE on `rope.dimension_count_swa` of each sliding
    head (the full layers' partial angles come from rope_freqs, _gemma4_file)."""
    out = _gemma_nano(get, cfg)
    n = cfg["num_hidden_layers"]
    kinds = out["layer_types"]
    head_full = int(get("attention.key_length") or cfg["head_dim"])
    head_swa = int(get("attention.key_length_swa") or head_full)
    kv = _per_layer(get, "attention.head_count_kv", n)
    swa_kv = next((k for k, t in zip(kv, kinds, strict=True) if t == "sliding_attention"),
                  kv[0])
    out.update(head_dim=head_swa, global_head_dim=head_full, num_key_value_heads=swa_kv,
               per_layer_config={str(i): {"head_dim": head_full, "num_key_value_heads": k}
                                 for i, (k, t) in enumerate(zip(kv, kinds, strict=True))
                                 if t == "full_attention"})
    ff = _per_layer(get, "feed_forward_length", n)
    first_shared = n - out["num_kv_shared_layers"]
    wide = [2 * ff[0] if i >= first_shared else ff[0] for i in range(n)]
    if ff != [ff[0]] * n and ff != wide:
        raise ValueError(f"gemma4: feed_forward_length {ff} is neither one width nor twice "
                         f"it on the {n - first_shared} layers that read shared KV")
    out.update(intermediate_size=ff[0], use_double_wide_mlp=ff != [ff[0]] * n)
    experts = get("expert_count")
    out.update(enable_moe_block=bool(experts))
    if experts:
        out.update(num_experts=experts, top_k_experts=get("expert_used_count"),
                   moe_intermediate_size=get("expert_feed_forward_length"))
    rotary_swa = get("rope.dimension_count_swa")
    if rotary_swa and int(rotary_swa) != head_swa:
        out["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = \
            int(rotary_swa) / head_swa
    return out


def _gemma4_file(header: GGUFHeader, cfg: dict[str, Any]) -> dict[str, Any]:
    """The full layers' "proportional" RoPE: the converter writes rope_freqs, one factor per
    angle of a full head, 1 for the rotated ones and 1e30 for the rest (so their angles stay
    ~0); the rotated share is the partial_rotary_factor. Values equal to keys where a full
    layer that owns its KV has no attn_v. The per-layer vocabulary from its table."""
    n = cfg["num_hidden_layers"]
    full = dict(cfg["rope_parameters"]["full_attention"], rope_type="proportional")
    if "rope_freqs.weight" in header.tensors:
        factors = read_f32_values(header, "rope_freqs.weight")
        full["partial_rotary_factor"] = sum(1 for f in factors if f == 1.0) / len(factors)
    first_shared = n - cfg["num_kv_shared_layers"]
    owners = [i for i, t in enumerate(cfg["layer_types"][:first_shared])
              if t == "full_attention"]
    k_eq_v = bool(owners) and all(f"blk.{i}.attn_v.weight" not in header.tensors
                                  for i in owners)
    out: dict[str, Any] = {
        "rope_parameters": {**cfg["rope_parameters"], "full_attention": full},
        "attention_k_eq_v": k_eq_v}
    if k_eq_v:
        kv = [c["num_key_value_heads"] for c in cfg["per_layer_config"].values()]
        out["num_global_key_value_heads"] = kv[0]
    per_layer = header.tensors.get("per_layer_token_embd.weight")
    if per_layer is not None:
        out["vocab_size_per_layer_input"] = per_layer.shape[0]
    return out


def _nextn(get: Callable[[str], Any], cfg: dict[str, Any]) -> int:
    """Multi-token-prediction layers the converter appended after the others (`nextn`)."""
    return int(get("nextn_predict_layers") or 0)


def _qwen3_5(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Gated DeltaNet where `attention.recurrent_layers` says, gated attention elsewhere;
    the `ssm.*` keys give the DeltaNet shape (state_size = key head size, group_count = key
    heads, time_step_rank = value heads); partial RoPE; the MRoPE sections kept (text
    positions rotate alike in every section). The `nextn` layers after `block_count -
    nextn_predict_layers` are the MTP block (kept by the weight loader, not run)."""
    mtp = _nextn(get, cfg)
    n = cfg["num_hidden_layers"]
    recurrent = get("attention.recurrent_layers")
    interval = int(get("full_attention_interval") or 4)
    if not isinstance(recurrent, list):
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    value_heads = int(get("ssm.time_step_rank"))
    rope = dict(cfg["rope_parameters"])
    rope["partial_rotary_factor"] = cfg.get("partial_rotary_factor", 1.0)
    sections = get("rope.dimension_sections")
    if isinstance(sections, list):
        rope.update(mrope_section=[int(x) for x in sections[:3]], mrope_interleaved=True)
    out: dict[str, Any] = {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n]],
        "full_attention_interval": interval,
        "linear_conv_kernel_dim": get("ssm.conv_kernel"),
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_num_key_heads": get("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
        "rope_parameters": rope, "mtp_num_hidden_layers": mtp}
    if get("expert_count"):
        out.update(_moe(get, cfg))
        out["decoder_sparse_step"] = 1
    return out


def _qwen3_next(get: Callable[[str], Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's layout (the DeltaNet's value heads left grouped; no MRoPE sections), always
    with experts and a gated shared expert."""
    out = _qwen3_5(get, cfg)
    out["rope_parameters"].pop("mrope_section", None)
    out["rope_parameters"].pop("mrope_interleaved", None)
    return out


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", permuted_qk=True),
    "qwen2": Arch("qwen2", _qwen_window),
    "qwen3": Arch("qwen3", _qwen_window),
    "qwen2moe": Arch("qwen2_moe", _qwen2moe, tensors=_dense_layers),
    "qwen3moe": Arch("qwen3_moe", _moe),
    "mamba": Arch("mamba", _mamba, tensors=_ssm_biases, attention_free=True),
    "mamba2": Arch("mamba2", _mamba2, tensors=_ssm_biases, attention_free=True),
    "gemma2": Arch("gemma2", _gemma2, norm_shift=1.0, tie_default=True),
    "gemma3": Arch("gemma3_text", _gemma3, norm_shift=1.0, tie_default=True),
    "nemotron_h": Arch("nemotron_h", _nemotron_h, tensors=_ssm_biases, per_layer_kv=True),
    # Phi-3: fused attn_qkv and ffn_up (gate|up); every layer sliding where the file says.
    "phi3": Arch("phi3"),
    # StarCoder 2: biased LayerNorms and projections, a gelu c_fc/c_proj MLP.
    "starcoder2": Arch("starcoder2", _starcoder2, tensors=_starcoder2_tensors),
    "lfm2": Arch("lfm2", _lfm2, tensors=_lfm2_tensors, per_layer_kv=True),
    "falcon-h1": Arch("falcon_h1", _falcon_h1, tensors=_falcon_h1_tensors),
    "jamba": Arch("jamba", _jamba, tensors=_jamba_tensors, per_layer_kv=True),
    "granitehybrid": Arch("granitemoehybrid", _granite_hybrid, permuted_qk=True,
                          tensors=_ssm_biases, per_layer_kv=True),
    "lfm2moe": Arch("lfm2_moe", _lfm2_moe, tensors=_lfm2_tensors, per_layer_kv=True),
    "smollm3": Arch("smollm3", _smollm3, permuted_qk=True),
    "exaone4": Arch("exaone4", _exaone4),
    "olmo2": Arch("olmo3", _olmo3),
    # Norms stored as 1 + w but the DeltaNet's gated norm (ssm_norm), as the converter adds.
    "qwen3next": Arch("qwen3_next", _qwen3_next, norm_shift=1.0,
                      norm_kept=("ssm_norm.weight",), nextn=_nextn),
    "qwen35": Arch("qwen3_5_text", _qwen3_5, norm_shift=1.0, norm_kept=("ssm_norm.weight",),
                   nextn=_nextn),
    "qwen35moe": Arch("qwen3_5_moe_text", _qwen3_5, norm_shift=1.0,
                      norm_kept=("ssm_norm.weight",), nextn=_nextn),
    # Gemma 3n / 4: norms stored as they are (their RMSNorm has no 1 + w).
    "gemma3n": Arch("gemma3n_text", _gemma3n, tie_default=True, mixed_layers=True,
                    from_file=_gemma3n_file),
    "gemma4": Arch("gemma4_text", _gemma4, tie_default=True, mixed_layers=True,
                   from_file=_gemma4_file),
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

    layers = _int(header, f"{arch_name}.block_count", need("block_count")) - arch.nextn(get, {})
    hidden = _int(header, f"{arch_name}.embedding_length", need("embedding_length"))
    heads = _int(header, f"{arch_name}.attention.head_count", need("attention.head_count"))
    kv_value = get("attention.head_count_kv") or heads
    ff_value = get("feed_forward_length") or 0
    if arch.mixed_layers:
        kv_value, ff_value = (v[0] if isinstance(v, list) and v else v
                              for v in (kv_value, ff_value))
    if arch.per_layer_kv and isinstance(kv_value, list):
        # Hybrids: 0 marks a recurrent layer; the attention layers share one count.
        kv_value = [v for v in kv_value if v] or [heads]
    kv_heads = _int(header, f"{arch_name}.attention.head_count_kv", kv_value)
    if arch.per_layer_kv and isinstance(ff_value, list):
        # Hybrids: 0 marks a layer without an MLP; the others share one width.
        ff_value = [v for v in ff_value if v] or [0]
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
        "intermediate_size": _int(header, f"{arch_name}.feed_forward_length", ff_value),
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
    try:
        cfg.update({k: v for k, v in arch.extra(get, cfg).items() if v is not None})
        cfg.update(arch.tensors(header.tensors.keys(), cfg))
        cfg.update(arch.from_file(header, cfg))
    except ValueError as e:  # an architecture's own check: named with the file
        if str(header.path) in str(e):
            raise
        raise ValueError(f"{header.path}: {e}") from None
    return cfg
