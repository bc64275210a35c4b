"""Per-request readiness for state layers whose state is one tensor (a short conv's window,
a linear-attention matrix): the one-tensor counterpart of `state.request_states`."""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch

from hybridkv.worker.state import StateMetadata


def request_single_states(meta: StateMetadata, states: torch.Tensor,
                          skip: Collection[int] = ()
                          ) -> Iterator[tuple[int, int, torch.Tensor,
                                              list[tuple[int, torch.Tensor]]]]:
    """Per request with tokens this step, but those in `skip`: (start, end, its live state
    made ready, checkpoints to fill as (offset, state)). The live state is restored from a
    prefix-hit checkpoint, zeroed for a fresh start, or left to continue."""
    for r in range(len(meta.state_pages)):
        start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
        if start == end or r in skip:
            continue
        state = states[meta.state_pages[r], meta.state_slots[r]]
        source = meta.init_from[r]
        if source is not None:
            state.copy_(states[source])
        elif not meta.has_initial_state[r]:
            state.zero_()
        yield start, end, state, [(offset, states[p, s])
                                  for offset, p, s in meta.checkpoints[r]]
