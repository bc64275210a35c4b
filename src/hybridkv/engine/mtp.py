"""The multi-token-prediction head of `speculative_config` method `mtp`: built beside the
target from the checkpoint's own MTP weights (models/qwen3_next_mtp.py), its attention layer
added to the KV cache plan as a draft layer (engine/draft.py's DraftParts, so it joins the
target's full-attention group: each block holds the head's page beside the target's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.draft import DraftParts
from hybridkv.kv.spec import FullAttentionSpec, KVCacheSpec
from hybridkv.models.formats.gguf_file import read_header
from hybridkv.models.formats.loader import LoadedModel
from hybridkv.models.formats.mtp_weights import (
    gguf_mtp_layers,
    hf_mtp_names,
    iter_hf_mtp_weights,
    load_gguf_mtp,
    num_mtp_layers,
)
from hybridkv.models.qwen3_next_mtp import MTP_ATTENTION, MTP_MODEL_TYPES, Qwen3NextMTP
from hybridkv.models.sources import resolve_model
from hybridkv.worker.linear.layers import choose_kernel, fuse_linears
from hybridkv.worker.spec.draft_model import DRAFT_PREFIX
from hybridkv.worker.spec.mtp import MTPDrafter


def load_mtp(model: str, target: LoadedModel, hf_config: dict[str, Any],
             target_specs: dict[str, KVCacheSpec], *, kv_cache_dtype: str, dtype: torch.dtype,
             device: str, linear_kernel: str, dequantize: bool) -> DraftParts:
    """The head of `model` (the target's directory or GGUF file), sharing `target`'s
    embedding and LM head. Every refusal is one line."""
    text = hf_config.get("text_config") or hf_config
    model_type = str(text.get("model_type") or hf_config.get("model_type"))
    what = f"speculative_config method 'mtp': {model}"
    if model_type not in MTP_MODEL_TYPES:
        raise ValueError(f"{what} is {model_type}; multi-token-prediction heads run for "
                         f"{', '.join(MTP_MODEL_TYPES)}")
    if kv_cache_dtype == "q4":
        raise ValueError(f"{what}: kv_cache_dtype 'q4' is not supported with an MTP head "
                         f"(its pages would need key staging of their own); use int8")
    source = resolve_model(model)
    head = Qwen3NextMTP(hf_config, target.model)  # type: ignore[arg-type]
    if source.is_gguf:
        tensors = tuple(getattr(target.model, "mtp_tensors", ()))
        layers = gguf_mtp_layers(tensors, int(text["num_hidden_layers"]))
        _check_layers(what, layers, "nextn tensors in the GGUF (convert without --no-mtp)")
        head.to(device=device, dtype=dtype)
        load_gguf_mtp(head, read_header(source.path), tensors, hf_config,
                      dequantize=dequantize)
    else:
        names = hf_mtp_names(Path(source.path))
        _check_layers(what, num_mtp_layers(names), "mtp.* tensors in its safetensors")
        head.to(dtype=dtype)
        head.load_weights(iter_hf_mtp_weights(Path(source.path)))
        head.to(device)
    head.eval()
    fuse_linears(head, choose_kernel(linear_kernel, device, dtype))
    full = [s for s in target_specs.values() if isinstance(s, FullAttentionSpec)
            and s.sliding_window is None and s.attention_chunk_size is None]
    if not full:
        raise ValueError(f"{what}: the target has no full-attention layer whose KV spec the "
                         f"head's attention could take")
    return DraftParts(name=f"MTP head of {model}", model=head,
                      layer_specs={DRAFT_PREFIX + MTP_ATTENTION: full[-1]}, kv_sharing={},
                      max_position_embeddings=None, make_drafter=MTPDrafter)


def _check_layers(what: str, layers: int, where: str) -> None:
    if layers == 0:
        raise ValueError(f"{what} has no multi-token-prediction weights (no {where}); use "
                         f"method 'ngram' or 'draft_model'")
    if layers > 1:
        raise ValueError(f"{what} has {layers} MTP layers; this engine runs one")
