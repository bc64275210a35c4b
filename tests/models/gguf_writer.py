"""Tiny GGUF files written by the tests: a Hugging Face model directory (tests/models/tiny.py)
turned into llama.cpp's layout with the `gguf` package's writer: its metadata keys, its tensor
names (the package's own name table), q/k rows permuted as llama.cpp's converter permutes them
for the llama architecture, Gemma's norms stored as (1 + w), and matrices quantized to the
types asked for (the `gguf` package's quantizers where it has one; K-quant blocks, which it
cannot quantize to, are random bytes with small scales: the file still says what the weights
are, and every reader must read them alike)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file

# llama.cpp architecture name per Hugging Face model_type.
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "smollm3": "smollm3"}
PERMUTED_QK = {"llama"}
GEMMA = {"gemma2", "gemma3"}

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
               default: T = T.Q8_0, seed: int = 0) -> Path:
    """`qtypes`: GGUF tensor-name fragment -> type for matrices (first match), e.g.
    {"attn_q": T.Q4_K}; other matrices get `default`; vectors stay F32."""
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
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 1e4))))
    writer.add_vocab_size(int(config["vocab_size"]))
    if config.get("sliding_window") and arch in GEMMA:
        writer.add_sliding_window(int(config["sliding_window"]))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            writer.add_float32(f"{arch}.{key}", float(config[key]))
    table = gguf.get_tensor_name_map(
        next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), n)
    rng = np.random.default_rng(seed)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for hf_name, value in sorted(tensors.items()):
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        value = value.astype(np.float32)
        if arch in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight")):
            value = _permute(value, heads if "attn_q" in name else kv_heads)
        if arch in GEMMA and name.endswith("norm.weight"):
            value = value + 1.0
        qtype = T.F32
        if value.ndim == 2:
            qtype = next((t for frag, t in (qtypes or {}).items() if frag in name), default)
        data = _quantize(value, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=qtype if qtype != T.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
