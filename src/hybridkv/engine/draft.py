"""The draft model of `speculative_config` method `draft_model`: loaded and checked beside the
target, its layers added to the KV cache plan under worker/spec/draft_model.py's DRAFT_PREFIX.

Its KV pages are layers of the one plan, so they come out of the same budget and arena: a
draft layer joins the target's group of its kind (each block then holds the draft's pages
beside the target's, under one block id) or makes a group of its own where the target has
none of that kind (a pure state target). The startup log states what they cost per token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from hybridkv.kv.spec import AttentionSpec, KVCacheSpec
from hybridkv.models.formats.loader import LoadedModel
from hybridkv.models.layer_mix import kv_layout_from_config
from hybridkv.models.sources import resolve_model
from hybridkv.sched.spec import SpeculativeConfig
from hybridkv.worker.spec.draft_model import DRAFT_PREFIX, DraftModel

logger = logging.getLogger(__name__)

# (the loaded model, its HF config, its dtype name), as the target is loaded.
Load = Callable[[str], tuple[LoadedModel, dict[str, Any], str]]


@dataclass(frozen=True)
class DraftParts:
    name: str
    model: nn.Module
    layer_specs: dict[str, KVCacheSpec]  # named with DRAFT_PREFIX
    kv_sharing: dict[str, str]  # likewise
    max_position_embeddings: int | None
    # The worker half that drafts with `model` (an MTP head has its own, worker/spec/mtp.py).
    make_drafter: Callable[..., DraftModel] = DraftModel

    def check_max_model_len(self, max_model_len: int) -> None:
        limit = self.max_position_embeddings
        if limit is not None and max_model_len > limit:
            raise ValueError(f"speculative_config draft model {self.name}: its "
                             f"max_position_embeddings ({limit}) is below max_model_len "
                             f"({max_model_len}); lower max_model_len or pick another draft")

    def describe(self, target_specs: dict[str, KVCacheSpec]) -> str:
        """One line for the startup log: where the draft's KV lives and its cost."""
        def per_token(specs: dict[str, KVCacheSpec]) -> int:
            return sum(s.bytes_per_token for s in specs.values() if isinstance(s, AttentionSpec))

        target = {n: s for n, s in target_specs.items() if not n.startswith(DRAFT_PREFIX)}
        return (f"draft model {self.name}: {len(self.layer_specs)} attention layers in the "
                f"KV cache plan beside the target's (same arena and budget, same block ids "
                f"in groups of the same kind): {per_token(self.layer_specs)} bytes per token "
                f"more than the target's {per_token(target)}")


def load_draft(config: SpeculativeConfig, load: Load, *, block_size: int, kv_dtype: str,
               kv_cache_dtype: str, vocab_size: int, tokenizer: Any | None) -> DraftParts:
    """Load `config.model` and check it can draft for a target of `vocab_size` tokens (and
    `tokenizer`, when both have one). Every refusal is one line."""
    name = str(config.model)
    what = f"speculative_config draft model {name!r}"
    if kv_cache_dtype == "q4":
        raise ValueError(f"{what}: kv_cache_dtype 'q4' is not supported with a draft model "
                         f"(its pages would need key staging of their own); use int8")
    if not resolve_model(name).path.exists():
        raise ValueError(f"{what}: no such file or directory (give the draft model's "
                         f"directory, .gguf file or a known model's name)")
    loaded, hf_config, _ = load(name)
    text_cfg = hf_config.get("text_config") or hf_config
    draft_vocab = int(text_cfg["vocab_size"])
    if draft_vocab != vocab_size:
        raise ValueError(f"{what} has a vocabulary of {draft_vocab} tokens, the target "
                         f"{vocab_size}: a draft model must share the target's vocabulary")
    if tokenizer is not None and loaded.tokenizer is not None and \
            tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        raise ValueError(f"{what}: its tokenizer maps tokens differently from the target's; "
                         f"a draft model must share the target's vocabulary")
    layout = kv_layout_from_config(hf_config, block_size=block_size, kv_dtype=kv_dtype)
    states = sorted({spec.kind for spec in layout.layer_specs.values() if spec.is_state})
    if states:
        raise ValueError(f"{what} has state layers ({', '.join(states)}); draft models must "
                         f"be attention-only (a rejected draft cannot be taken back from a "
                         f"recurrent state without a checkpoint)")
    return DraftParts(
        name=name, model=loaded.model,
        layer_specs={DRAFT_PREFIX + n: s for n, s in layout.layer_specs.items()},
        kv_sharing={DRAFT_PREFIX + n: DRAFT_PREFIX + t for n, t in layout.kv_sharing.items()},
        max_position_embeddings=layout.max_position_embeddings)
