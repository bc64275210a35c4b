"""Load a Hugging Face–format model directory: config, weights, tokenizer, EOS ids."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hybridkv.models.config_check import check_config
from hybridkv.models.formats.gguf_file import GGUFHeader
from hybridkv.models.layer_mix import SUPPORTED_MODEL_TYPES
from hybridkv.models.registry import build_model
from hybridkv.models.weights import no_init
from hybridkv.worker.cpu_malloc import release_free_memory
from hybridkv.worker.linear.layers import choose_kernel, fuse_linears


@dataclass
class LoadedModel:
    model: nn.Module
    config: dict[str, Any]
    tokenizer: Any | None  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]
    # GGUF: what the file says for chat (a directory's are read from its files).
    chat_template: str | None = None
    special_tokens: dict[str, str] | None = None


def read_json(path: Path) -> Any:
    """A JSON file, or one line naming it and what is wrong with it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None


def read_config(model_dir: Path) -> dict[str, Any]:
    if not model_dir.is_dir():
        raise ValueError(f"model path {model_dir} does not exist or is not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: missing config.json")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: no weight_map (an object of tensor name -> shard "
                             f"file name)")
        return [model_dir / s for s in sorted(set(weight_map.values()))]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    raise ValueError(f"{model_dir}: missing model.safetensors (or its sharded index)")


def iter_weights(model_dir: Path, integer: tuple[str, ...] = ()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors; integer ones only where their names end with one of
    `integer` (a family's tables, e.g. DeepSeek-V4's token -> experts map)."""
    files = weight_files(model_dir)
    for file in files:
        if not file.is_file():
            raise ValueError(f"{model_dir}: missing weight shard {file.name}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())  # noqa: SIM118  (safe_open is not a mapping)
                for name in names:
                    tensor = f.get_tensor(name)
                    if not tensor.is_floating_point() and not name.endswith(integer):
                        raise ValueError(f"{file}: tensor {name!r} is {tensor.dtype}; the "
                                         f"engine loads floating-point weights only")
                    yield name, tensor
        except (OSError, RuntimeError, SafetensorError) as e:
            raise ValueError(f"{file}: not a readable safetensors file "
                             f"({_first_line(e)})") from None


def eos_ids(model_dir: Path, config: dict[str, Any]) -> tuple[int, ...]:
    eos: Any = None
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        gen_config = read_json(gen)
        if not isinstance(gen_config, dict):
            raise ValueError(f"{gen}: expected a JSON object, got {type(gen_config).__name__}")
        eos = gen_config.get("eos_token_id")
        source = f"{gen}: eos_token_id"
    if eos is None:
        eos = config.get("eos_token_id")
        source = f"{model_dir / 'config.json'}: eos_token_id"
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{source} must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def read_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for a malformed file
        raise ValueError(f"{path}: not a readable tokenizer ({_first_line(e)})") from None


def load_model(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device | str,
               config: dict[str, Any] | None = None,
               linear_kernel: str | None = "auto") -> LoadedModel:
    """`config`: the directory's config.json when the caller has read it already;
    `linear_kernel`: see worker/linear/layers.py (None: leave the checkpoint's nn.Linear
    modules)."""
    path = Path(model_dir)
    config = config if config is not None else read_config(path)
    # The small files first: a broken tokenizer is reported before minutes of weights load.
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = read_tokenizer(path / "tokenizer.json")
    eos = eos_ids(path, config)
    text = config.get("text_config") or config
    if (text.get("model_type") or config.get("model_type")) in SUPPORTED_MODEL_TYPES:
        check_config(config, str(path / "config.json"), for_model=True)
    with no_init():
        model = build_model(config)  # an unsupported architecture is refused here
    model.to(dtype=dtype)
    model.load_weights(iter_weights(path, integer=getattr(model, "integer_weights", ())))
    model.to(device)
    model.eval()
    if linear_kernel is not None:
        fuse_linears(model, choose_kernel(linear_kernel, device, dtype))
    return LoadedModel(model, config, tokenizer, eos)


def _first_line(error: BaseException) -> str:
    """Libraries' messages can span lines; an error here is one line."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_gguf_model(header: GGUFHeader, config: dict[str, Any], *,
                    device: torch.device | str, dtype: torch.dtype,
                    linear_kernel: str | None = "auto", dequantize: bool = False,
                    ) -> LoadedModel:
    """A GGUF model: its tokenizer from the file's metadata, its weights kept in their
    blocks on the CPU (formats/gguf_weights.py). Elsewhere (CUDA), or with `dequantize`, the
    weights are dequantized at load and the model runs in `dtype` as any checkpoint does."""
    from hybridkv.models.formats.gguf_tokenizer import tokenizer_from_gguf
    from hybridkv.models.formats.gguf_weights import build_gguf_model

    on_cpu = torch.device(device).type == "cpu"
    quantized = on_cpu and not dequantize
    if quantized and dtype != torch.float32:
        raise ValueError(f"{header.path}: weights kept quantized compute with float32 "
                         f"activations; dtype {str(dtype).removeprefix('torch.')} needs "
                         f"dequantize=True (--dequantize)")
    # A file without a vocabulary (tests' tiny models) runs on token ids, as a directory
    # without tokenizer.json does.
    info = tokenizer_from_gguf(header.metadata, source=str(header.path)) \
        if "tokenizer.ggml.model" in header.metadata else None
    if on_cpu:
        release_free_memory()  # the tokenizer's build temporaries, before the weights come
    check_config(config, str(header.path), for_model=True)
    model = build_gguf_model(header, config, dequantize=not quantized)
    if not quantized:
        model.to(dtype=dtype)
    model.to(device)
    if linear_kernel is not None:
        fuse_linears(model, choose_kernel(linear_kernel, device, dtype))
    if info is None:
        eos = config.get("eos_token_id")
        return LoadedModel(model, config, None, (eos,) if isinstance(eos, int) else ())
    eos_ids = info.eos_token_ids or (
        (info.eos_token_id,) if info.eos_token_id is not None else ())
    special = {name: value for name, value in (("bos_token", info.bos_token),
                                               ("eos_token", info.eos_token)) if value}
    return LoadedModel(model, config, info.tokenizer, tuple(eos_ids), info.chat_template,
                       special)
