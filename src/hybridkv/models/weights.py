"""Copy checkpoint tensors into a model whose parameter names follow the checkpoint's."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

# Checkpoints of multimodal wrappers keep the text model under another prefix: the current
# layout (`model.language_model.*`: Gemma 3n/4, Qwen3.5) or the older one transformers still
# writes for Gemma 3 and Llama 4 (`language_model.model.*`, `language_model.lm_head.*`).
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."), ("backbone.", "model."))
# Parts of multimodal checkpoints that text generation does not run (vision and audio towers,
# their projectors into the text model), in both layouts; skipped for every model.
MULTIMODAL_PARTS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                    "model.embed_audio.", "model.multi_modal_projector.", "model.visual.",
                    "model.vision_model.", "vision_tower.", "vision_model.", "audio_tower.",
                    "multi_modal_projector.")


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Build a model without initialising the matrices it is about to be given: the random
    init of a float32 model's Linear and Embedding weights costs seconds (~8 s for Gemma 3
    270M) and writes pages that the checkpoint's values then overwrite, or, for a quantized
    model whose float32 copies are never used, pages that need never be touched. Safe because
    every loader refuses a checkpoint that lacks a parameter (load_named_weights)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = lambda self: None  # type: ignore[method-assign]
    nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                       model_type: str, tied: bool, unused: tuple[str, ...] = ()) -> None:
    """Names and shapes must match and nothing may be missing; each mistake is one line.
    Tensors whose names start with one of `unused` are skipped (weights a checkpoint keeps
    for parts this engine does not run, e.g. k/v projections of KV-sharing layers), and so are
    the vision/audio parts of multimodal checkpoints (MULTIMODAL_PARTS)."""
    params = dict(model.named_parameters())
    loaded = set()
    for name, tensor in weights:
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
        if name not in params:
            if (name == "lm_head.weight" and tied) or name.endswith("rotary_emb.inv_freq") \
                    or name.startswith(unused) or name.startswith(MULTIMODAL_PARTS):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {model_type}")
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. "
                         f"{sorted(missing)[0]!r}")


def renamed(weights: Iterable[tuple[str, torch.Tensor]], rules: Iterable[tuple[str, str]]
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names rewritten by (regex, replacement) rules, applied in order: for
    checkpoints that name a part differently from the model here (Mixtral's `w1`/`w3`/`w2`)."""
    compiled = [(re.compile(pattern), repl) for pattern, repl in rules]
    for name, tensor in weights:
        for pattern, repl in compiled:
            name = pattern.sub(repl, name)
        yield name, tensor


def split_rows(weights: Iterable[tuple[str, torch.Tensor]], fused: str,
               parts: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors named `...{fused}weight` / `bias` cut along their first dim into the `parts`
    (name fragment -> rows, in order), e.g. Phi-3's `qkv_proj` into q, k and v."""
    for name, tensor in weights:
        if fused not in name:
            yield name, tensor
            continue
        if tensor.shape[0] != sum(parts.values()):
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; "
                             f"expected {sum(parts.values())} ({', '.join(parts)})")
        for part, piece in zip(parts, tensor.split(list(parts.values())), strict=True):
            yield name.replace(fused, part), piece
