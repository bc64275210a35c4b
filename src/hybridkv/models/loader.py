"""Load a Hugging Face–format model directory: config, weights, tokenizer, EOS ids."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from hybridkv.models.registry import build_model


@dataclass
class LoadedModel:
    model: nn.Module
    config: dict[str, Any]
    tokenizer: Any | None  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]


def read_config(model_dir: Path) -> dict[str, Any]:
    if not model_dir.is_dir():
        raise ValueError(f"model path {model_dir} does not exist or is not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: missing config.json")
    return dict(json.loads(path.read_text()))


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise ValueError(f"{model_dir}: missing model.safetensors (or its sharded index)")
    for file in files:
        if not file.is_file():
            raise ValueError(f"{model_dir}: missing weight shard {file.name}")
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def eos_ids(model_dir: Path, config: dict[str, Any]) -> tuple[int, ...]:
    eos: Any = None
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_model(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device | str,
               config: dict[str, Any] | None = None) -> LoadedModel:
    """`config`: the directory's config.json when the caller has read it already."""
    path = Path(model_dir)
    config = config if config is not None else read_config(path)
    model = build_model(config)
    model.to(dtype=dtype)
    model.load_weights(iter_weights(path))  # type: ignore[operator]
    model.to(device)
    model.eval()
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return LoadedModel(model, config, tokenizer, eos_ids(path, config))
