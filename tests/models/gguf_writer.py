"""Tiny GGUF files written by the tests: a Hugging Face model directory (tests/models/tiny.py)
turned into llama.cpp's layout with the `gguf` package's writer: its metadata keys, its tensor
names (the package's own name table), q/k rows permuted as llama.cpp's converter permutes them
for the llama architecture, Gemma's norms stored as (1 + w), and matrices quantized to the
types asked for (the `gguf` package's quantizers where it has one; K-quant blocks, which it
cannot quantize to, are random bytes with small scales: the file still says what the weights
are, and every reader must read them alike). The Gated DeltaNet families are rewritten as
llama.cpp's Qwen3NextModel / Qwen3.5 converters do: A = -exp(A_log), norms as (1 + w) but
the gated one, squeezed conv kernels, Qwen3-Next's in_proj_qkvz split into attn_qkv and
attn_gate, and Qwen3.5's value heads reordered from grouped to tiled."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file, save_file

# llama.cpp architecture name per Hugging Face model_type.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "smollm3": "smollm3",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "phi3": "phi3",
             "starcoder2": "starcoder2", "mamba": "mamba", "mamba2": "mamba2", "lfm2": "lfm2",
             "nemotron_h": "nemotron_h", "granitemoehybrid": "granitehybrid",
             "jamba": "jamba", "falcon_h1": "falcon-h1", "exaone4": "exaone4",
             "olmo3": "olmo2", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe",
             "qwen3_next": "qwen3next", "lfm2_moe": "lfm2moe", "gemma3n_text": "gemma3n",
             "gemma3n": "gemma3n", "gemma4_text": "gemma4"}
# granite, smollm3: LlamaModel's modify_tensors
PERMUTED_QK = {"llama", "granitehybrid", "smollm3"}
# Sliding layers as a per-layer pattern (True = sliding), as Exaone4Model / Olmo2Model write it.
WINDOW_PATTERN = {"exaone4", "olmo2"}
GEMMA = {"gemma2", "gemma3"}
# Tensors llama.cpp's converter always writes as F32 (besides vectors and norms).
F32_TENSORS = ("ffn_gate_inp", "ssm_conv1d", "shortconv.conv")
SSM = {"mamba", "mamba2"}
# Gated DeltaNet hybrids (Qwen3NextModel's converter and its Qwen3.5 subclasses).
DELTANET = {"qwen35", "qwen35moe", "qwen3next"}
# Qwen3.5's converter reorders the DeltaNet's value heads (grouped by key head -> tiled).
TILED_V = {"qwen35", "qwen35moe"}
# Short-convolution families (LFM2Model / LFM2MoeModel's converters).
LFM2 = {"lfm2", "lfm2moe"}
# Gemma 3n / Gemma 4 (Gemma3NModel / Gemma4Model's converters; norms stored as they are).
GEMMA_NANO = {"gemma3n", "gemma4"}
# Files given a vocabulary (transformers' reader wants one for these).
VOCAB = {"lfm2"}
# Mamba-2 mixers (as the mamba2 converter writes them) inside hybrids.
MAMBA2 = {"mamba2", "nemotron_h", "granitehybrid", "falcon-h1"}
# Hybrids: per-layer head_count_kv (0 = not an attention layer).
HYBRID = {"nemotron_h", "granitehybrid", "jamba"}

# Byte offsets of the float16 scales in each K-quant block (the rest may be any bytes).
_K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _quantize(values: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F32:
        return values.astype(np.float32)
    if qtype not in _K_SCALES:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    raw = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    for offset in _K_SCALES[qtype]:
        scale = rng.uniform(2e-4, 6e-4, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k: per head, halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(model_dir: Path, out: Path, qtypes: dict[str, T] | None = None, *,
               default: T = T.Q8_0, seed: int = 0, rounded: Path | None = None) -> Path:
    """`qtypes`: GGUF tensor-name fragment -> type for matrices (first match), e.g.
    {"attn_q": T.Q4_K}; other matrices get `default`; vectors stay F32. `rounded`: also save
    the Hugging Face checkpoint with each weight replaced by its value as stored in the file
    (quantized and back; rows are quantized alike in both layouts), the reference for
    architectures transformers cannot read from GGUF (no K-quants there: their blocks here
    are random bytes)."""
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    n = int(config.get("num_hidden_layers") or len(config["layers_block_type"]))
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    writer = gguf.GGUFWriter(str(out), arch)
    # Qwen3.5 / Qwen3-Next's multi-token-prediction block, as `nextn` layers after the others.
    mtp = int(config.get("mtp_num_hidden_layers") or 0) if arch in DELTANET else 0
    writer.add_block_count(n + mtp)
    if mtp:
        writer.add_nextn_predict_layers(mtp)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    if arch in SSM:  # no attention, no MLP: llama.cpp's converter writes zeros
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
    elif arch in HYBRID:
        _hybrid_metadata(writer, arch, config, n, heads, kv_heads, head_dim)
    elif arch in GEMMA_NANO:
        _gemma_nano_metadata(writer, arch, config, n, heads, kv_heads, head_dim)
    else:
        writer.add_feed_forward_length(_ff_length(arch, config))
        writer.add_head_count(heads)
        # LFM2: per layer, 0 marking the convolution layers.
        writer.add_head_count_kv([0 if t == "conv" else kv_heads for t in config["layer_types"]]
                                 if arch in LFM2 else kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 1e4))))
    writer.add_vocab_size(int(config["vocab_size"]))
    _arch_metadata(writer, arch, config)
    if config.get("sliding_window") and arch in GEMMA:
        writer.add_sliding_window(int(config["sliding_window"]))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            writer.add_float32(f"{arch}.{key}", float(config[key]))
    table = gguf.get_tensor_name_map(
        next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), n + mtp)
    rng = np.random.default_rng(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    stored: dict[str, np.ndarray] = {}
    entries, undo = _converted(arch, config, tensors)
    for hf_name, value, sources in entries:
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias")) or (
            hf_name if hf_name.startswith(("blk.", "rope_freqs.")) else None)
        assert name is not None, hf_name
        # Entries the table writes with their suffix (Falcon-H1's pre_ff_layernorm.weight)
        # give the name without it, and llama.cpp's converter writes that (blk.N.ffn_norm).
        value = value.astype(np.float32)
        if arch in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight")):
            value = _permute(value, heads if "attn_q" in name else kv_heads)
        if (arch in GEMMA and name.endswith("norm.weight")) or (
                arch in DELTANET and name.endswith("norm.weight")
                and not name.endswith("ssm_norm.weight")):
            value = value + 1.0  # the DeltaNet's gated norm (ssm_norm) is kept as it is
        qtype = T.F32
        if value.ndim >= 2 and name.endswith(".weight") and not name.endswith("norm.weight") \
                and not any(frag in name for frag in F32_TENSORS):
            qtype = next((t for frag, t in (qtypes or {}).items() if frag in name), default)
            if value.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
                qtype = T.F16  # rows that no block fits: the converter falls back to F16
        # Quantization runs along rows: a 3-D expert tensor is quantized as [experts * rows].
        data = _quantize(value.reshape(-1, value.shape[-1]) if value.ndim > 2 else value,
                         qtype, rng)
        data = data.reshape(*value.shape[:-1], -1) if qtype != T.F32 else value
        writer.add_tensor(name, data, raw_dtype=qtype if qtype != T.F32 else None)
        # The MTP block stays out of the rounded checkpoint (transformers does not run it).
        for source in (s for s in sources if not s.startswith("mtp.")) if rounded else ():
            # A part of a split tensor ("name#k"): its rows as handed over.
            original = (value if "#" in source else tensors[source]).astype(np.float32)
            if qtype == T.F32:
                stored[source] = original
                continue
            assert qtype not in _K_SCALES, "no rounded checkpoint of random K-quant blocks"
            rows = original.reshape(-1, original.shape[-1])
            stored[source] = gguf.quants.dequantize(_quantize(rows, qtype, rng), qtype).reshape(
                original.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for key in sorted(k for k in stored if "#" in k):  # split tensors joined back
        name = key.partition("#")[0]
        stored[name] = np.concatenate([stored.get(name, stored[key][..., :0, :]),
                                       stored.pop(key)], axis=-2)
    for name, back in undo.items() if rounded is not None else ():
        # Rows / columns the converter moved, moved back (safetensors wants C order).
        stored[name] = np.ascontiguousarray(back(stored[name]))
    if rounded is not None:
        rounded.mkdir(parents=True, exist_ok=True)
        (rounded / "config.json").write_text(json.dumps(
            {**config, **FOLDED.get(model_type, {})}, indent=2))
        save_file(stored, str(rounded / "model.safetensors"), metadata={"format": "pt"})
    return out


def _ff_length(arch: str, config: dict[str, Any]) -> int:
    size = int(config["intermediate_size"])
    if arch == "lfm2" and config.get("block_auto_adjust_ff_dim", True):
        # llama.cpp's converter writes the width the model builds (as LFM2's config computes).
        size = int(2 * size / 3)
        if config.get("block_ffn_dim_multiplier") is not None:
            size = int(config["block_ffn_dim_multiplier"] * size)
        multiple = int(config["block_multiple_of"])
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def _hybrid_metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any], n: int,
                     heads: int, kv_heads: int, head_dim: int) -> None:
    """As llama.cpp's GraniteHybrid/NemotronH converters: head_count_kv per layer (0 for
    the other layers), NemotronH's feed_forward_length per layer (0 but on MLP layers), the
    Mamba-2 mixer's ssm.* keys."""
    if arch == "jamba":  # JambaModel's converter
        period, offset = int(config["attn_layer_period"]), int(config["attn_layer_offset"])
        inner = int(config["mamba_expand"]) * int(config["hidden_size"])
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(heads)
        writer.add_head_count_kv([kv_heads if i >= offset and (i - offset) % period == 0
                                  else 0 for i in range(n)])
        writer.add_ssm_conv_kernel(int(config["mamba_d_conv"]))
        writer.add_ssm_inner_size(inner)
        writer.add_ssm_state_size(int(config["mamba_d_state"]))
        writer.add_ssm_time_step_rank(int(config["mamba_dt_rank"]))
        writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
        return
    kinds = config.get("layers_block_type") or config["layer_types"]
    ff = int(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv([kv_heads if k in ("attention", "full_attention") else 0
                              for k in kinds])
    writer.add_feed_forward_length([ff if k == "mlp" else 0 for k in kinds]
                                   if arch == "nemotron_h" else ff)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(float(_first(config, "layer_norm_epsilon", "rms_norm_eps")))
    ssm_heads = int(_first(config, "mamba_num_heads", "mamba_n_heads"))
    writer.add_ssm_conv_kernel(int(_first(config, "conv_kernel", "mamba_d_conv")))
    writer.add_ssm_state_size(int(_first(config, "ssm_state_size", "mamba_d_state")))
    writer.add_ssm_group_count(int(_first(config, "n_groups", "mamba_n_groups")))
    writer.add_ssm_inner_size(ssm_heads * int(_first(config, "mamba_head_dim", "mamba_d_head")))
    writer.add_ssm_time_step_rank(ssm_heads)
    if arch == "granitehybrid":  # GraniteMoe's keys; RoPE flagged by rope.scaling.finetuned
        writer.add_expert_feed_forward_length(ff)
        writer.add_expert_shared_feed_forward_length(int(config["shared_intermediate_size"]))
        writer.add_attention_scale(float(config["attention_multiplier"]))
        writer.add_embedding_scale(float(config["embedding_multiplier"]))
        writer.add_residual_scale(float(config["residual_multiplier"]))
        writer.add_logit_scale(float(config["logits_scaling"]))
        writer.add_rope_scaling_finetuned(config.get("position_embedding_type") == "rope")


def _gemma_nano_metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any], n: int,
                         heads: int, kv_heads: int, head_dim: int) -> None:
    """As Gemma3NModel / Gemma4Model's converters: MLP widths per layer (Gemma 4's shared-KV
    layers twice as wide where use_double_wide_mlp), the sliding pattern, a RoPE base per
    layer type; Gemma 3n's AltUp keys and its activation sparsity as the normal quantile a
    gate keeps above; Gemma 4's full layers with their own head size and KV heads."""
    from statistics import NormalDist

    kinds = config["layer_types"]
    ff = config["intermediate_size"]
    shared = int(config.get("num_kv_shared_layers") or 0)
    if arch == "gemma4":
        wide = 2 if config.get("use_double_wide_mlp") else 1
        ff = [int(ff) * (wide if i >= n - shared else 1) for i in range(n)]
    writer.add_feed_forward_length([int(f) for f in ff] if isinstance(ff, list) else int(ff))
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_sliding_window(int(config["sliding_window"]))
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in kinds])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(int(config.get("hidden_size_per_layer_input")
                                                    or 0))
    writer.add_rope_freq_base_swa(float(
        config["rope_parameters"]["sliding_attention"]["rope_theta"]))
    if arch == "gemma3n":
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_altup_active_idx(int(config["altup_active_idx"]))
        writer.add_altup_num_inputs(int(config["altup_num_inputs"]))
        writer.add_activation_sparsity_scale([
            NormalDist().inv_cdf(s) if s > 0 else float("-inf")
            for s in config["activation_sparsity_pattern"]])
        return
    full = config["per_layer_config"]
    full_head = int(next(iter(full.values()))["head_dim"])
    writer.add_head_count_kv([kv_heads if t == "sliding_attention"
                              else int(full[str(i)]["num_key_value_heads"])
                              for i, t in enumerate(kinds)])
    writer.add_key_length(full_head)
    writer.add_value_length(full_head)
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    writer.add_rope_dimension_count(full_head)  # the partial angles are in rope_freqs
    writer.add_rope_dimension_count_swa(int(head_dim * config["rope_parameters"][
        "sliding_attention"].get("partial_rotary_factor", 1.0)))


# What a family's rewrite gives for one checkpoint tensor: [(name, value, sources)] and how
# the rounded checkpoint's tensor is moved back from the file's layout (or None).
Rewritten = tuple[list[tuple[str, np.ndarray, list[str]]],
                  Callable[[np.ndarray], np.ndarray] | None]


def _gemma_nano(arch: str, config: dict[str, Any], hf_name: str, value: np.ndarray,
                source: str) -> Rewritten | None:
    """Gemma3NModel / Gemma4Model's rewrites of one tensor, or None: Gemma 3n's per-layer
    table padded with zero rows to the vocabulary; the names its filter gives "_scale"
    tensors and Gemma 4's layer scalar (".weight" added); Gemma 4's router scale and
    per-expert scale written by hand beside the router and the experts' down projection."""
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else ""
    if arch == "gemma3n" and hf_name.endswith("embed_tokens_per_layer.weight"):
        rows = value.shape[0]
        padded = np.concatenate([value, np.zeros((int(config["vocab_size"]) - rows,
                                                  value.shape[1]), value.dtype)])
        return [(hf_name, padded, [f"{source}#0"])], lambda stored: stored[:rows]
    if (arch == "gemma3n" and hf_name.endswith("_scale")) or hf_name.endswith(".layer_scalar"):
        name = hf_name + ".weight"
    elif arch == "gemma4" and hf_name.endswith("router.scale"):
        name = f"blk.{layer}.ffn_gate_inp.scale"
    elif arch == "gemma4" and hf_name.endswith("router.per_expert_scale"):
        name = f"blk.{layer}.ffn_down_exps.scale"
    elif arch == "gemma4" and re.search(r"\.experts\.(gate_up_proj|down_proj)$", hf_name):
        name = hf_name + ".weight"
    else:
        return None
    return [(name, value, [source])], None


def _falcon_h1_fold(config: dict[str, Any], name: str, w: np.ndarray) -> np.ndarray | None:
    """FalconH1Model.modify_tensors: the µP multipliers folded into the matrices."""
    attn_in = float(config["attention_in_multiplier"])
    scales = {"feed_forward.down_proj": float(config["mlp_multipliers"][1]),
              "feed_forward.gate_proj": float(config["mlp_multipliers"][0]),
              "self_attn.k_proj": float(config["key_multiplier"]) * attn_in,
              "self_attn.q_proj": attn_in, "self_attn.v_proj": attn_in,
              "self_attn.o_proj": float(config["attention_out_multiplier"]),
              "mamba.out_proj": float(config["ssm_out_multiplier"]),
              "lm_head": float(config["lm_head_multiplier"]),
              "embed_tokens": float(config["embedding_multiplier"])}
    for part, scale in scales.items():
        if f"{part}.weight" in name:
            return w * scale
    if "mamba.in_proj.weight" in name:
        inner, gn = int(config["mamba_d_ssm"]), int(config["mamba_n_groups"]) * int(
            config["mamba_d_state"])
        sizes = [inner, inner, gn, gn, int(config["mamba_n_heads"])]
        mup = np.repeat(np.array(config["ssm_multipliers"], dtype=np.float32), sizes)
        return w * float(config["ssm_in_multiplier"]) * mup[:, None]
    return None


# Config fields a rounded checkpoint drops: the converter folded them into its weights.
FOLDED = {"falcon_h1": dict(
    attention_in_multiplier=1.0, attention_out_multiplier=1.0, key_multiplier=1.0,
    ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, embedding_multiplier=1.0,
    lm_head_multiplier=1.0, mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5)}


def _byte_vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    """A gpt2-style vocabulary of `size` tokens, bytes in GPT-2's byte-to-character map: what
    transformers' reader needs to build the model (the tests feed token ids)."""
    chars = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in chars:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    # The last token is a merge of two "!" (the writer leaves an empty merge list out, and
    # the readers want the key).
    writer.add_token_list([table[b] for b in range(size - 1)] + ["!!"])
    writer.add_token_types([1] * size)
    writer.add_token_merges(["! !"])


def _first(config: dict[str, Any], *keys: str) -> Any:
    return next(config[k] for k in keys if config.get(k) is not None)


def _arch_metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    """The keys llama.cpp's converter adds for the architecture."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(_first(config, "num_experts_per_tok",
                                                "top_k_experts")))
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(
            int(config["shared_expert_intermediate_size"]))
    if arch == "phi3":
        # The tokenizer's pad id (transformers' Phi-3 default, 32000, is past a tiny vocab).
        writer.add_pad_token_id(int(config["pad_token_id"]))
        rotary = int(config.get("partial_rotary_factor", 1.0) * int(config["head_dim"]))
        writer.add_rope_dimension_count(rotary)
        if config.get("sliding_window"):
            writer.add_sliding_window(int(config["sliding_window"]))
    if arch == "starcoder2":
        writer.add_layer_norm_eps(float(config["norm_epsilon"]))
    if arch in WINDOW_PATTERN and config.get("sliding_window"):
        writer.add_sliding_window(int(config["sliding_window"]))
        writer.add_sliding_window_pattern([t == "sliding_attention"
                                           for t in config["layer_types"]])
        if arch == "olmo2":
            writer.add_rope_freq_base_swa(float(
                config["rope_parameters"]["sliding_attention"]["rope_theta"]))
    if arch in ("mamba", "mamba2"):
        writer.add_ssm_conv_kernel(int(config["conv_kernel"]))
        writer.add_ssm_state_size(int(config["state_size"]))
        writer.add_layer_norm_rms_eps(float(config["layer_norm_epsilon"]))
    if arch == "mamba":
        writer.add_ssm_inner_size(int(config["intermediate_size"]))
        writer.add_ssm_time_step_rank(int(config["time_step_rank"]))
        writer.add_ssm_dt_b_c_rms(False)
    if arch == "mamba2":
        inner = int(config["expand"]) * int(config["hidden_size"])
        writer.add_ssm_inner_size(inner)
        writer.add_ssm_time_step_rank(inner // int(config["head_dim"]))
        writer.add_ssm_group_count(int(config["n_groups"]))
    if arch == "falcon-h1":  # FalconH1Model's converter (over Mamba2Model's keys)
        heads = int(config["mamba_n_heads"])
        writer.add_ssm_conv_kernel(int(config["mamba_d_conv"]))
        writer.add_ssm_state_size(int(config["mamba_d_state"]))
        writer.add_ssm_group_count(int(config["mamba_n_groups"]))
        writer.add_ssm_inner_size(int(config["mamba_d_ssm"]))
        writer.add_ssm_time_step_rank(heads)
    if arch in VOCAB:
        _byte_vocabulary(writer, int(config["vocab_size"]))
    if arch in LFM2:
        writer.add_shortconv_l_cache(int(config["conv_L_cache"]))
        writer.add_layer_norm_rms_eps(float(config["norm_eps"]))
    if arch == "lfm2moe":  # LFM2MoeModel's converter
        writer.add_leading_dense_block_count(int(config["num_dense_layers"]))
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if arch in DELTANET:  # Qwen3NextModel's converter
        writer.add_ssm_conv_kernel(int(config["linear_conv_kernel_dim"]))
        writer.add_ssm_state_size(int(config["linear_key_head_dim"]))
        writer.add_ssm_group_count(int(config["linear_num_key_heads"]))
        writer.add_ssm_time_step_rank(int(config["linear_num_value_heads"]))
        writer.add_ssm_inner_size(int(config["linear_value_head_dim"])
                                  * int(config["linear_num_value_heads"]))
        # (the installed gguf package has no add_recurrent_layers; the key is llama.cpp's)
        writer.add_array(f"{arch}.attention.recurrent_layers",
                         [t == "linear_attention" for t in config["layer_types"]]
                         + [False] * int(config.get("mtp_num_hidden_layers") or 0))
        writer.add_full_attention_interval(int(config.get("full_attention_interval", 4)))
        rope = config.get("rope_parameters") or {}
        writer.add_rope_dimension_count(int(int(config["head_dim"])
                                            * rope.get("partial_rotary_factor", 0.25)))
    if arch in TILED_V:  # Qwen3.5 always writes MRoPE sections (its default where unset)
        sections = (config.get("rope_parameters") or {}).get("mrope_section") or [11, 11, 10]
        writer.add_rope_dimension_sections([*sections, 0][:4])


def _grouped_to_tiled(num_k_heads: int, num_v_heads: int, width: int) -> np.ndarray:
    """For each file position along a value-head dimension, the Hugging Face index it holds:
    Qwen3.5's converter reorders value heads grouped by key head into tiled order, e.g. 2 key
    heads, 4 value heads: v0 v1 | v2 v3 -> v0 v2 v1 v3 (each head `width` long)."""
    per_k = num_v_heads // num_k_heads
    return np.arange(num_v_heads * width).reshape(num_k_heads, per_k, width).transpose(
        1, 0, 2).reshape(-1)


def _deltanet(arch: str, config: dict[str, Any], hf_name: str, value: np.ndarray,
              source: str) -> Rewritten | None:
    """Qwen3NextModel's (and Qwen3.5's) rewrites of one linear-attention tensor, or None:
    conv1d squeezed, dt_bias as the dt projection's bias, Qwen3-Next's in_proj_qkvz split,
    Qwen3.5's value heads tiled (the rounded tensor moved back where quantization blocks do
    not commute with the reorder)."""
    if ".linear_attn." not in hf_name:
        return None
    if value.ndim == 3 and value.shape[1] == 1:
        value = value.squeeze(1)  # conv1d [C, 1, K]
    hf_name = hf_name.replace(".dt_bias", ".dt_proj.bias")
    nk, nv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    dk, dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    if arch == "qwen3next" and hf_name.endswith("linear_attn.in_proj_qkvz.weight"):
        # Per key head [q | k | its v heads | their z] -> [all q | all k | all v] and [all z].
        per_k = nv // nk * dv
        q, k, v, z = np.split(value.reshape(nk, -1, value.shape[-1]),
                              np.cumsum([dk, dk, per_k]), axis=1)
        layer = hf_name.split(".")[2]
        qkv = np.concatenate([part.reshape(-1, value.shape[-1]) for part in (q, k, v)])

        def regroup(joined: np.ndarray) -> np.ndarray:
            parts = np.split(joined, np.cumsum([nk * dk, nk * dk, nk * per_k]))
            return np.concatenate([p.reshape(nk, -1, joined.shape[-1]) for p in parts],
                                  axis=1).reshape(joined.shape)
        return [(f"blk.{layer}.attn_qkv.weight", qkv, [f"{source}#0"]),
                (f"blk.{layer}.attn_gate.weight", z.reshape(-1, value.shape[-1]),
                 [f"{source}#1"])], regroup
    if arch not in TILED_V or nk == nv:
        return [(hf_name, value, [source])], None
    if hf_name.endswith("out_proj.weight"):
        # Columns reordered: quantized blocks hold other values, moved back after rounding.
        order = _grouped_to_tiled(nk, nv, dv)
        return [(hf_name, value[:, order], [f"{source}#0"])], \
            lambda stored: stored[:, np.argsort(order)]
    if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        qk = 2 * nk * dk
        order = np.concatenate([np.arange(qk), qk + _grouped_to_tiled(nk, nv, dv)])
    elif hf_name.endswith("in_proj_z.weight"):
        order = _grouped_to_tiled(nk, nv, dv)
    elif hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_proj.bias")):
        order = _grouped_to_tiled(nk, nv, 1)
    else:
        return [(hf_name, value, [source])], None
    # Whole rows move: each is quantized on its own, so the rounded source needs no undo.
    return [(hf_name, value[order], [source])], None


def _mtp_name(name: str, num_layers: int) -> str:
    """A checkpoint's `mtp.*` tensor under the name _QwenMtpMixin gives it: its decoder
    layers after the model's own, its fc and norms as that layer's nextn tensors."""
    parts = name.split(".", 3)
    if parts[1] == "layers":
        return f"model.layers.{num_layers + int(parts[2])}.{parts[3]}"
    nextn = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm",
             "pre_fc_norm_hidden": "hnorm", "norm": "shared_head_norm"}[parts[1]]
    return f"blk.{num_layers}.nextn.{nextn}.{parts[2]}"


def _converted(arch: str, config: dict[str, Any], tensors: dict[str, np.ndarray]
               ) -> tuple[list[tuple[str, np.ndarray, list[str]]],
                          dict[str, Callable[[np.ndarray], np.ndarray]]]:
    """The checkpoint's tensors as llama.cpp's converter hands them to its name table:
    experts stacked into one 3-D tensor per matrix, Mamba's A_log as A = -exp(A_log),
    convolution weights squeezed, Mamba-2's A/D per head as [heads, 1] and its gated norm
    per group, dt_bias as the dt projection's bias; the DeltaNet's rewrites (_deltanet).
    Also, per source parameter, how its rounded value is moved back from the file's layout."""
    out: dict[str, tuple[np.ndarray, list[str]]] = {}
    undo: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
    experts: dict[str, dict[int, str]] = {}
    for source, value in tensors.items():
        hf_name = source
        if source.startswith("mtp."):
            hf_name = _mtp_name(source, int(config["num_hidden_layers"]))
        if hf_name.endswith(".A_log"):
            value = -np.exp(value.astype(np.float32))
        rewrite = _gemma_nano if arch in GEMMA_NANO else _deltanet if arch in DELTANET \
            else None
        if rewrite is not None and (rewritten := rewrite(arch, config, hf_name, value,
                                                         source)) is not None:
            parts, back = rewritten
            for name, part, sources in parts:
                out[name] = part, sources
            if back is not None:
                undo[source] = back
            continue
        if (m := re.match(r"model\.(altup_projections|altup_unembed_projections)\.(\d+)\."
                          r"weight$", hf_name)) is not None:
            # Gemma 3n's AltUp matrices stacked as one tensor [copies, hidden, hidden].
            experts.setdefault(f"model.{m[1]}.weight", {})[int(m[2])] = source
            continue
        if (m := re.match(r"(.*\.experts)\.(\d+)\.(.*)$", hf_name)) is not None:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = source
            continue
        if hf_name.endswith("shared_expert_gate.weight") and arch not in DELTANET:
            # [1, hidden] as a vector, as published Qwen-MoE files (Qwen3NextModel keeps it)
            value = value.reshape(-1)
        if arch == "lfm2moe" and hf_name.endswith(".expert_bias"):
            hf_name += ".bias"  # LFM2MoeModel's name for the routing bias
        if arch in ("mamba", *LFM2, "jamba", *MAMBA2) and value.ndim == 3 \
                and value.shape[1] == 1:
            # conv [C, 1, K]
            value = value.squeeze(1)
        if arch in MAMBA2:
            if hf_name.endswith((".A_log", ".D")):
                value = value.reshape(-1, 1)
            if hf_name.endswith((".mixer.norm.weight", ".mamba.norm.weight")):
                value = value.reshape(int(_first(config, "n_groups", "mamba_n_groups")), -1)
            if hf_name.endswith(".dt_bias"):
                hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
        if arch == "falcon-h1" and value.ndim == 2:
            folded = _falcon_h1_fold(config, hf_name, value.astype(np.float32))
            if folded is not None:
                out[hf_name] = folded, [f"{source}#0"]
                continue
        if (m := re.match(r"model\.layers\.(\d+)\.(block_sparse_moe|shared_mlp)\."
                          r"input_linear\.weight$", hf_name)) is not None:
            # Granite's fused [gate | up] rows, split as llama.cpp's converter splits them.
            kind = "exps" if m[2] == "block_sparse_moe" else "shexp"
            gate, up = np.split(value, 2, axis=-2)
            out[f"blk.{m[1]}.ffn_gate_{kind}.weight"] = gate, [f"{source}#0"]
            out[f"blk.{m[1]}.ffn_up_{kind}.weight"] = up, [f"{source}#1"]
            continue
        out[hf_name] = value, [source]
    if arch == "gemma4":
        # Full layers' "proportional" RoPE as Gemma4Model writes it: a factor per angle, 1 for
        # the rotated ones, 1e30 (an angle of ~0) for the others.
        full = config["rope_parameters"]["full_attention"]
        half = int(next(iter(config["per_layer_config"].values()))["head_dim"]) // 2
        rotated = int(half * float(full["partial_rotary_factor"]))
        out["rope_freqs.weight"] = np.array([1.0] * rotated + [1e30] * (half - rotated),
                                            dtype=np.float32), []
    for name, per_expert in experts.items():
        sources = [per_expert[e] for e in sorted(per_expert)]
        if arch == "lfm2moe":  # LFM2MoeModel names the stacked experts without "model."
            name = name.removeprefix("model.")
        out[name] = np.stack([tensors[s] for s in sources]), sources
    return [(name, value, sources) for name, (value, sources) in sorted(out.items())], undo


def copy_field(writer: gguf.GGUFWriter, name: str, field: Any) -> None:
    """One metadata field of a `gguf.GGUFReader` into `writer`, value type as it was."""
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        writer.add_key_value(name, list(field.contents()), kind, field.types[1])
    else:
        writer.add_key_value(name, field.contents(), kind)
