"""Short causal convolutions with a residual (Inkling's `sconv`s), several per layer, their
last inputs kept as one state of several tensors beside the layer's KV cache (the `sconv`
kind of layer_mix), in float32 as the reference computes them:

    y = (depthwise_causal_conv(x) + x) / divisor         # x [T, C], kernel K, no bias

State per request: conv i's last K - 1 inputs [C_i, K - 1]; zero for a fresh request;
checkpoints at block boundaries are those inputs there. A layer makes the states ready once
(`ready_states`: restored from a prefix hit, zeroed, or continued), then each conv reads and
updates its own tensor of them."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from hybridkv.worker.state import StateMetadata


class StateRun(NamedTuple):
    """One request's tokens this step, rows start..end, with its live states and the
    checkpoints to fill as (offset: tokens into the step, states there)."""

    start: int
    end: int
    live: tuple[torch.Tensor, ...]
    saves: list[tuple[int, tuple[torch.Tensor, ...]]]


def ready_states(meta: StateMetadata, states: tuple[torch.Tensor, ...]) -> list[StateRun]:
    """Per request with tokens this step, its live states made ready. Called once per layer
    and step: a second call would restore a prefix-hit checkpoint over states that the
    layer's earlier convs already moved on."""
    runs = []
    for r in range(len(meta.state_pages)):
        start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
        if start == end:
            continue
        page, slot = meta.state_pages[r], meta.state_slots[r]
        live = tuple(s[page, slot] for s in states)
        source = meta.init_from[r]
        for state, tensor in zip(live, states, strict=True):
            if source is not None:
                state.copy_(tensor[source])
            elif not meta.has_initial_state[r]:
                state.zero_()
        saves = [(offset, tuple(s[p, c] for s in states))
                 for offset, p, c in meta.checkpoints[r]]
        runs.append(StateRun(start, end, live, saves))
    return runs


def conv_window(x: torch.Tensor, run: StateRun, index: int) -> torch.Tensor:
    """[C, K - 1 + L]: state `index`'s last inputs, then the run's rows of x [T, C] (float32);
    moves the state and its checkpoints on."""
    state = run.live[index]
    keep = state.shape[-1]
    window = torch.cat([state, x[run.start:run.end].float().T], dim=-1)
    for offset, checkpoint in run.saves:
        checkpoint[index].copy_(window[:, offset:offset + keep])  # inputs up to `offset`
    state.copy_(window[:, -keep:])
    return window


class ResidualConv(nn.Module):
    """forward(x [T, C], runs, index) -> [T, C] in x's dtype; `index`: its state tensor."""

    def __init__(self, channels: int, kernel: int, *, divisor: float = 1.0) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)
        self.divisor = divisor  # Inkling 2: sqrt(K + 1)

    def forward(self, x: torch.Tensor, runs: list[StateRun], index: int) -> torch.Tensor:
        y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        weight = self.conv1d.weight.float()
        for run in runs:
            window = conv_window(x, run, index)
            y[run.start:run.end] = nn.functional.conv1d(
                window[None], weight, groups=weight.shape[0])[0].T
        y = y + x.float()
        if self.divisor != 1.0:
            y = y / self.divisor
        return y.to(x.dtype)
