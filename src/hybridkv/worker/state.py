"""Metadata for state groups (Mamba/SSM): where each request's live state lies."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class StateMetadata:
    """One state group's view of the batch (same request order as every group)."""

    query_start_loc: list[int]
    state_pages: list[int]  # the large page and slot of each request's live state block
    state_slots: list[int]
    has_initial_state: list[bool]  # computed tokens before this step: continue its state
    # A request starting from a prefix hit copies the checkpoint (page, slot) first.
    init_from: list[tuple[int, int] | None]
    # Per request: states to save, as (tokens into this step's chunk, page, slot).
    checkpoints: list[list[tuple[int, int, int]]]
    _plain_tokens: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    @cached_property
    def plain_steps(self) -> list[int]:
        """Requests taking one token from their own state with nothing to restore or save
        (the common decode step): the layers batch these."""
        loc = self.query_start_loc
        return [r for r in range(len(self.state_pages))
                if loc[r + 1] - loc[r] == 1 and self.has_initial_state[r]
                and self.init_from[r] is None and not self.checkpoints[r]]

    def plain_step_tokens(self, device: torch.device) -> torch.Tensor:
        """The flat batch index of each of `plain_steps`' tokens, built once per step for
        all the group's layers."""
        tokens = self._plain_tokens.get(device)
        if tokens is None:
            tokens = self._plain_tokens[device] = torch.tensor(
                [self.query_start_loc[r] for r in self.plain_steps], device=device)
        return tokens
