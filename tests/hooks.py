"""Test hooks into a live engine."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch


def record_logits(llm) -> dict[str, list[torch.Tensor]]:
    """Every sampled row's logits from now on, per request id, as float32 CPU tensors."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)

    def hook(request_ids: Sequence[str], logits: torch.Tensor) -> None:
        for row, rid in enumerate(request_ids):
            seen[rid].append(logits[row].float().cpu())

    llm.engine.runner.logits_hook = hook
    return seen
