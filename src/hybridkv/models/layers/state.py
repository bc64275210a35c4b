"""Per-request recurrent state in the KV cache arena, shared by every state mixer (Mamba1,
Mamba2, Gated DeltaNet): making each request's live state ready (restored from a prefix-hit
checkpoint, zeroed, or continued), and the causal depthwise convolution whose last inputs
are part of that state."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hybridkv.worker import cpu_ops
from hybridkv.worker.state import StateMetadata

Saves = list[tuple[int, torch.Tensor, torch.Tensor]]


def request_states(meta: StateMetadata, states: tuple[torch.Tensor, ...],
                   skip: Iterable[int] = ()
                   ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, Saves]]:
    """Per request with tokens this step: (start, end, conv state, SSM state, checkpoints
    to save), the live states made ready: copied from a prefix-hit checkpoint, zeroed for
    a fresh start, or left to continue. Requests come in row order, so a checkpoint written
    in this step by an earlier request is complete before a later one copies it."""
    conv_states, ssm_states = states
    skipped = set(skip)
    for r in range(len(meta.state_pages)):
        start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
        if start == end or r in skipped:
            continue
        page, slot = meta.state_pages[r], meta.state_slots[r]
        conv_state, ssm_state = conv_states[page, slot], ssm_states[page, slot]
        source = meta.init_from[r]
        if source is not None:
            conv_state.copy_(conv_states[source])
            ssm_state.copy_(ssm_states[source])
        elif not meta.has_initial_state[r]:
            conv_state.zero_()
            ssm_state.zero_()
        saves = [(offset, conv_states[p, s], ssm_states[p, s])
                 for offset, p, s in meta.checkpoints[r]]
        yield start, end, conv_state, ssm_state, saves


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, conv: nn.Conv1d,
                saves: Saves, native: bool = False) -> torch.Tensor:
    """Depthwise causal conv of x [L, channels] continuing from the last kernel - 1 inputs in
    `conv_state` [channels, kernel - 1]; updates it and the checkpoints' conv states.
    Returns [L, channels] (before the activation). `native` (the mixer's cpu ops on):
    float32 CPU tensors take one C call, 3-15x torch's depthwise conv1d on one core (53 ms
    against 3.6 ms for 2,048 tokens of 2,048 channels)."""
    if native and cpu_ops.takes(x) and cpu_ops.takes_state(conv_state):
        return cpu_ops.causal_conv(x, conv_state, conv.weight, conv.bias,
                                   {offset: c for offset, c, _ in saves}, silu=False)
    keep = conv.kernel_size[0] - 1
    window = torch.cat([conv_state.to(x.dtype), x.T], dim=-1)  # [channels, k-1+L]
    conv_state.copy_(window[:, -keep:])
    for offset, checkpoint, _ in saves:
        checkpoint.copy_(window[:, offset:offset + keep])  # inputs up to `offset` tokens
    return nn.functional.conv1d(window.unsqueeze(0), conv.weight, conv.bias,
                                groups=conv.in_channels)[0].T


def conv_step(x: torch.Tensor, conv_states: torch.Tensor, pages: torch.Tensor,
              slots: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """One token per request, all at once: x [R, channels], each request continuing from its
    conv state at (pages[r], slots[r]), which it updates. Returns [R, channels] (before the
    activation)."""
    window = torch.cat([conv_states[pages, slots].to(x.dtype), x[:, :, None]], -1)
    conv_states[pages, slots] = window[:, :, 1:].to(conv_states.dtype)
    out = (window * conv.weight[:, 0, :]).sum(-1)  # [R, channels]
    return out if conv.bias is None else out + conv.bias


def state_places(meta: StateMetadata, rows: list[int], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages [R], slots [R]) of the live states of `rows`."""
    return (torch.tensor([meta.state_pages[r] for r in rows], device=device),
            torch.tensor([meta.state_slots[r] for r in rows], device=device))
