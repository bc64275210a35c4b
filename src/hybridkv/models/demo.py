"""`hybridkv demo-model`: a tiny random model in Hugging Face format, with a small byte-level
BPE tokenizer trained here, so a new user can try everything without downloads.

The files are what `save_pretrained` would write for the architecture (config.json with the
usual field names, model.safetensors with the usual tensor names), so `transformers` loads them
too; the tests use that to check the engine against it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hybrid models mix sliding-window layers "
    "with full attention layers; a good engine keeps every byte of its KV cache busy, shares "
    "prefixes between requests and never recomputes what it already knows. "
    "Once upon a time, a small model learned to count: one, two, three, four, five. ")

# A plain chat template (`hybridkv serve` renders chat messages with it): one line per
# message, "role: content", then "assistant:" to prompt the reply.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                "sliding": "all"},
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
               "sliding": "alternate", "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
               "sliding": "5:1", "hidden_activation": "gelu_pytorch_tanh"},
    # Gemma 3n E4B's proportions: every 5th layer full, the last 3/7 of the layers read the
    # KV of earlier ones, AltUp, Laurel, per-layer inputs, sparse MLP gates in the first 2/7.
    "gemma3n": {"model_type": "gemma3n_text", "architectures": ["Gemma3nForCausalLM"],
                "sliding": "4:1", "hidden_activation": "gelu_pytorch_tanh",
                "final_logit_softcapping": 30.0},
    # Mamba2 / attention / MLP layers in Nemotron-H-8B's proportions ("M-M-M-M*-" repeated).
    "nemotron_h": {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
                   "sliding": "mamba"},
}


@dataclass(frozen=True)
class DemoShape:
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    vocab: int = 512
    window: int = 32
    max_position_embeddings: int = 4096
    seed: int = 0


# `demo-model --size`: small runs anything in seconds; medium (~100M parameters as a Llama)
# makes recomputing a prefix real work.
SIZES = {
    "small": DemoShape(layers=6, hidden=128, heads=4, kv_heads=2, head_dim=32,
                       intermediate=256, vocab=512, window=32),
    "medium": DemoShape(layers=12, hidden=768, heads=12, kv_heads=4, head_dim=64,
                        intermediate=3072, vocab=512, window=512),
}
MIN_VOCAB = 258  # the byte-level tokenizer: 256 bytes + <pad> + <eos>


def demo_shape(size: str = "small", *, head_dim: int | None = None,
               **overrides: int | None) -> DemoShape:
    """The `size` preset with the given fields replaced (None keeps the preset's); without
    `head_dim`, hidden / heads."""
    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; available: {', '.join(SIZES)}")
    shape = replace(SIZES[size], **{k: v for k, v in overrides.items() if v is not None})
    if head_dim is None:
        if shape.hidden % shape.heads:
            raise ValueError(f"hidden {shape.hidden} is not a multiple of heads {shape.heads}; "
                             f"give head-dim")
        head_dim = shape.hidden // shape.heads
    return replace(shape, head_dim=head_dim)


def check_shape(arch: str, shape: DemoShape) -> None:
    """Refuse, in one line, a shape the architecture cannot be built or run with."""
    if arch not in ARCHS:
        raise ValueError(f"unknown demo architecture {arch!r}; available: {', '.join(ARCHS)}")
    sizes = {name: getattr(shape, name) for name in (
        "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
        "window", "max_position_embeddings")}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if shape.heads % shape.kv_heads:
        raise ValueError(f"heads {shape.heads} is not a multiple of kv-heads {shape.kv_heads}")
    if shape.head_dim % 2:
        raise ValueError(f"head-dim {shape.head_dim} must be even (rotary embeddings rotate "
                         f"pairs)")
    if shape.vocab < MIN_VOCAB:
        raise ValueError(f"vocab {shape.vocab} is below the byte-level tokenizer's minimum "
                         f"({MIN_VOCAB}: 256 bytes + 2 special tokens)")
    if arch == "nemotron_h" and shape.layers < 3:
        raise ValueError(f"a nemotron_h demo model needs at least 3 layers (Mamba2, attention, "
                         f"MLP); --layers {shape.layers} is too few")
    if arch == "nemotron_h" and shape.hidden % shape.head_dim:
        # Mamba2 heads: 2 * hidden / head_dim of them, split into 2 groups.
        raise ValueError(f"hidden {shape.hidden} is not a multiple of head-dim "
                         f"{shape.head_dim}, which nemotron_h's Mamba2 heads need")

def train_tokenizer(out_dir: Path, vocab_size: int) -> int:
    """Train and save tokenizer.json; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([TRAINING_TEXT] * 10, trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return int(tokenizer.get_vocab_size())


def demo_config(arch: str, shape: DemoShape, vocab_size: int) -> dict[str, Any]:
    if arch not in ARCHS:
        raise ValueError(f"unknown demo architecture {arch!r}; available: {', '.join(ARCHS)}")
    spec = dict(ARCHS[arch])
    sliding = spec.pop("sliding", None)
    config: dict[str, Any] = {
        **spec, "vocab_size": vocab_size, "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0,
        "rope_theta": 10000.0,
    }
    if sliding is not None:
        config["sliding_window"] = shape.window
    if sliding == "alternate":
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(shape.layers)]
    elif sliding in ("5:1", "4:1"):
        period = 6 if sliding == "5:1" else 5
        config["layer_types"] = ["full_attention" if (i + 1) % period == 0
                                 else "sliding_attention" for i in range(shape.layers)]
        if "full_attention" not in config["layer_types"]:
            config["layer_types"][-1] = "full_attention"
        config["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
        del config["rope_theta"]
    if arch in ("gemma2", "gemma3"):
        config["query_pre_attn_scalar"] = shape.head_dim
    if arch == "gemma3n":
        shared = shape.layers * 3 // 7
        if shape.layers - shared < 5:
            raise ValueError(f"a gemma3n demo model needs at least 5 layers that own their KV "
                             f"(a sliding and a full one); --layers {shape.layers} gives "
                             f"{shape.layers - shared}, use --layers 8 or more")
        config.update(
            num_kv_shared_layers=shared, hidden_size_per_layer_input=max(shape.hidden // 8, 8),
            vocab_size_per_layer_input=vocab_size, laurel_rank=max(shape.hidden // 32, 4),
            altup_num_inputs=4, activation_sparsity_pattern=[
                0.95 if i < shape.layers * 2 // 7 else 0.0 for i in range(shape.layers)])
    if sliding == "mamba":
        del config["sliding_window"]
        config["hybrid_override_pattern"] = nemotron_h_pattern(shape.layers)
        config.update(mamba_num_heads=2 * shape.hidden // shape.head_dim,
                      mamba_head_dim=shape.head_dim, ssm_state_size=shape.head_dim,
                      n_groups=2, conv_kernel=4, layer_norm_epsilon=1e-5,
                      time_step_min=0.001)
    return config


def nemotron_h_pattern(num_layers: int) -> str:
    """Mamba2 (M), attention (*) and MLP (-) layers in Nemotron-H-8B's proportions; with 3
    layers or more at least one of each, so that short models are hybrids too.
    E.g. 9 -> "M-M-M-M*-", 6 -> "M-M-*-", 3 -> "M-*"."""
    pattern = ("M-M-M-M*-" * num_layers)[:num_layers]
    if "*" not in pattern and pattern.count("M") >= 2:
        last = pattern.rindex("M")
        pattern = pattern[:last] + "*" + pattern[last + 1:]
    return pattern


def write_demo_model(out_dir: str | Path, arch: str, shape: DemoShape | None = None) -> Path:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json (with a chat template)."""
    shape = shape or DemoShape()
    check_shape(arch, shape)
    config = demo_config(arch, shape, shape.vocab)
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    # Written next to the target and moved into place at the end: a failure leaves nothing
    # half-written.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_files(tmp, config, shape)
        if path.exists():  # an existing directory: replace our files in it, one by one
            for entry in tmp.iterdir():
                entry.replace(path / entry.name)
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_files(path: Path, config: dict[str, Any], shape: DemoShape) -> None:
    import torch
    from safetensors.torch import save_file

    from hybridkv.models.registry import build_model

    # The tokenizer learns at most `vocab` tokens from the small text; the model keeps the
    # requested vocabulary size (ids past the tokenizer's are simply never produced by it).
    train_tokenizer(path, shape.vocab)
    torch.manual_seed(shape.seed)
    model = build_model(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                continue  # identity norms (1 for Llama, 1 + 0 for Gemma)
            param.normal_(0.0, 0.1)  # wide enough that greedy output does not collapse
    tensors = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}, indent=2))
