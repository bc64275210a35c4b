"""Where a checkpoint keeps its multi-token-prediction head, per format: a Hugging Face
directory's `mtp.*` tensors (Qwen3-Next / Qwen3.5; transformers drops them), or the
`nextn` layer llama.cpp's converter appends after a GGUF model's own layers.

    HF                                  GGUF (layer N = the model's layer count)
    mtp.fc.weight                       blk.N.nextn.eh_proj.weight
    mtp.pre_fc_norm_embedding.weight    blk.N.nextn.enorm.weight          (+1, as all norms)
    mtp.pre_fc_norm_hidden.weight       blk.N.nextn.hnorm.weight
    mtp.norm.weight                     blk.N.nextn.shared_head_norm.weight
    mtp.layers.0.<part>                 blk.N.<part's name in llama.cpp's table for layer N>

The GGUF side loads through the model loader (formats/gguf_weights.py) on a view of the head
named as layer N of the target, so quantized matrices stay in their blocks and the
converter's rewrites (norm +1, expert stacking) are undone the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from hybridkv.models.formats.gguf_file import GGUFHeader, TensorInfo
from hybridkv.models.formats.loader import read_json, weight_files

MTP_PREFIX = "mtp."
_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def hf_mtp_names(model_dir: Path) -> list[str]:
    """The directory's `mtp.*` tensor names (none: it has no MTP head)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map") or {}
        return sorted(n for n in weight_map if n.startswith(MTP_PREFIX))
    names: list[str] = []
    for file in weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            names += [n for n in f.keys() if n.startswith(MTP_PREFIX)]  # noqa: SIM118
    return sorted(names)


def num_mtp_layers(names: list[str]) -> int:
    """Decoder layers of the head, from its tensor names (Qwen3-Next's config omits it)."""
    layers = {int(m.group(1)) for n in names if (m := _LAYER.match(n)) is not None}
    return max(layers) + 1 if layers else 0


def iter_hf_mtp_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every `mtp.*` tensor, read from the shards that hold them only."""
    index = model_dir / "model.safetensors.index.json"
    files = weight_files(model_dir)
    if index.is_file():
        weight_map = read_json(index).get("weight_map") or {}
        wanted = {weight_map[n] for n in weight_map if n.startswith(MTP_PREFIX)}
        files = [f for f in files if f.name in wanted]
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if name.startswith(MTP_PREFIX):
                    yield name, f.get_tensor(name)


def _nextn_layer(name: str) -> int | None:
    head, _, rest = name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "blk" and index.isdigit() else None


def gguf_mtp_layers(tensors: tuple[TensorInfo, ...], num_layers: int) -> int:
    """Layers of the `nextn` block among the tensors a GGUF model left in its file."""
    found = {i for t in tensors if (i := _nextn_layer(t.name)) is not None and i >= num_layers}
    return len(found)


class _LayerView(nn.Module):
    """The head's modules under the names a converted file gives them at layer N: the
    decoder layer's own parts, and the nextn projections beside them."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        for name, module in head.get_submodule("layers.0").named_children():
            self.add_module(name, module)
        self.eh_proj = head.fc
        self.enorm = head.pre_fc_norm_embedding
        self.hnorm = head.pre_fc_norm_hidden
        self.shared_head = nn.Module()
        self.shared_head.norm = head.norm


def load_gguf_mtp(head: nn.Module, header: GGUFHeader, tensors: tuple[TensorInfo, ...],
                  config: dict[str, Any], *, dequantize: bool) -> None:
    """Place the `nextn` layer's tensors (those of the file's layer N = the model's layer
    count, among `tensors`) in `head`. The view's loader may swap a linear for its
    quantized module; those are put back on the head (the decoder layer's own are swapped
    inside modules the head shares)."""
    from hybridkv.models.formats.gguf_weights import load_gguf_weights

    text = config.get("text_config") or config
    n = int(text["num_hidden_layers"])
    view = _LayerView(head)
    container = _Container()
    container.model = nn.Module()
    container.model.layers = nn.ModuleDict({str(n): view})
    mine = {t.name: t for t in tensors if _nextn_layer(t.name) == n}
    only = replace(header, tensors=mine)
    # The view is the file's layers 0..n with only layer n present; no tied head to place.
    load_gguf_weights(container, only,  # type: ignore[arg-type]
                      {**text, "num_hidden_layers": n + 1, "tie_word_embeddings": False},
                      dequantize=dequantize)
    head.fc = view.eh_proj
    layer = head.get_submodule("layers.0")
    for name, module in view.named_children():
        if name in dict(layer.named_children()):
            setattr(layer, name, module)


class _Container(nn.Module):
    embed_tokens = None  # (the loader looks for a tied head to place: there is none)
