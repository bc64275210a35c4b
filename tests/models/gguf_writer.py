"""Tiny GGUF files written by the tests: a Hugging Face model directory (tests/models/tiny.py)
turned into llama.cpp's layout with the `gguf` package's writer: its metadata keys, its tensor
names (the package's own name table), q/k rows permuted as llama.cpp's converter permutes them
for the llama architecture, Gemma's norms stored as (1 + w), and matrices quantized to the
types asked for (the `gguf` package's quantizers where it has one; K-quant blocks, which it
cannot quantize to, are random bytes with small scales: the file still says what the weights
are, and every reader must read them alike)."""

from __future__ import annotations

import json
import re
import shutil
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
             "starcoder2": "starcoder2", "mamba": "mamba", "mamba2": "mamba2", "lfm2": "lfm2"}
PERMUTED_QK = {"llama"}
GEMMA = {"gemma2", "gemma3"}
# Tensors llama.cpp's converter always writes as F32 (besides vectors and norms).
F32_TENSORS = ("ffn_gate_inp", "ssm_conv1d", "shortconv.conv")
SSM = {"mamba", "mamba2"}

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
    n = int(config["num_hidden_layers"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(n)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    if arch in SSM:  # no attention, no MLP: llama.cpp's converter writes zeros
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
    else:
        writer.add_feed_forward_length(_ff_length(arch, config))
        writer.add_head_count(heads)
        # LFM2: per layer, 0 marking the convolution layers.
        writer.add_head_count_kv([0 if t == "conv" else kv_heads for t in config["layer_types"]]
                                 if arch == "lfm2" else kv_heads)
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
        next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), n)
    rng = np.random.default_rng(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    stored: dict[str, np.ndarray] = {}
    for hf_name, value, sources in _converted(arch, config, tensors):
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        value = value.astype(np.float32)
        if arch in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight")):
            value = _permute(value, heads if "attn_q" in name else kv_heads)
        if arch in GEMMA and name.endswith("norm.weight"):
            value = value + 1.0
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
        for source in sources if rounded is not None else ():
            original = tensors[source].astype(np.float32)
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
    if rounded is not None:
        rounded.mkdir(parents=True, exist_ok=True)
        shutil.copy(model_dir / "config.json", rounded / "config.json")
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


def _arch_metadata(writer: gguf.GGUFWriter, arch: str, config: dict[str, Any]) -> None:
    """The keys llama.cpp's converter adds for the architecture."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(
            int(config["shared_expert_intermediate_size"]))
    if arch == "phi3":
        rotary = int(config.get("partial_rotary_factor", 1.0) * int(config["head_dim"]))
        writer.add_rope_dimension_count(rotary)
        if config.get("sliding_window"):
            writer.add_sliding_window(int(config["sliding_window"]))
    if arch == "starcoder2":
        writer.add_layer_norm_eps(float(config["norm_epsilon"]))
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
    if arch == "lfm2":
        writer.add_shortconv_l_cache(int(config["conv_L_cache"]))
        writer.add_layer_norm_rms_eps(float(config["norm_eps"]))


def _converted(arch: str, config: dict[str, Any], tensors: dict[str, np.ndarray]
               ) -> list[tuple[str, np.ndarray, list[str]]]:
    """The checkpoint's tensors as llama.cpp's converter hands them to its name table:
    experts stacked into one 3-D tensor per matrix, Mamba's A_log as A = -exp(A_log),
    convolution weights squeezed, Mamba-2's A/D per head as [heads, 1] and its gated norm
    per group, dt_bias as the dt projection's bias."""
    out: dict[str, tuple[np.ndarray, list[str]]] = {}
    experts: dict[str, dict[int, str]] = {}
    for source, value in tensors.items():
        hf_name = source
        if (m := re.match(r"(.*\.experts)\.(\d+)\.(.*)$", hf_name)) is not None:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = source
            continue
        if hf_name.endswith("shared_expert_gate.weight"):
            value = value.reshape(-1)  # [1, hidden] as a vector, as published Qwen-MoE files
        if hf_name.endswith(".A_log"):
            value = -np.exp(value.astype(np.float32))
        if arch in ("mamba", "mamba2", "lfm2") and value.ndim == 3:  # conv [C, 1, K]
            value = value.squeeze(1)
        if arch == "mamba2":
            if hf_name.endswith((".A_log", ".D")):
                value = value.reshape(-1, 1)
            if hf_name.endswith(".mixer.norm.weight"):
                value = value.reshape(int(config["n_groups"]), -1)
            if hf_name.endswith(".dt_bias"):
                hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
        out[hf_name] = value, [source]
    for name, per_expert in experts.items():
        sources = [per_expert[e] for e in sorted(per_expert)]
        out[name] = np.stack([tensors[s] for s in sources]), sources
    return [(name, value, sources) for name, (value, sources) in sorted(out.items())]
