"""DeepSeek-V4's window compressor: every window of `rate` tokens becomes one entry,

    kv, gate = wkv(h), wgate(h)                      per token, C channels
    entry w  = norm(sum_j softmax_j(gate_j + ape_j) kv_j)   j over the window's rate tokens
    entry w  = RoPE at position w x rate, on its last rope dims (adjacent pairs)

and, with `overlap` (CSA; the indexer's own compressor too), C = 2 x width: the first
`width` channels of a token (Ca) belong to the next window's entry, the last (Cb) to its own,
so entry w pools window w - 1's Ca with window w's Cb over 2 x rate slots (window -1 has none:
its gates are -inf, weight 0).

Per request the state (CompressorStateSpec) carries what crosses a step: the kv and gate rows
of the tokens since the last closed window (position mod rate of them) and, with overlap, the
last closed window's Ca kv and gate (gate with `ape` added). A step's tokens extend the rows
of the unfinished window; every window they close gives an entry. A checkpoint at a window
boundary p is the state there: no rows, and window p / rate - 1's Ca."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridkv.models.layers.residual_conv import StateRun

Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [m, 1, D], positions [m])


def rms_norm_weighted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4's RMSNorm: normalised in float32, times the (float32) weight, cast once."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


class V4Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_weighted(x, self.weight, self.eps)


class WindowCompressor(nn.Module):
    """Checkpoint names: wkv, wgate, ape, norm. `states` index: where this compressor's
    tensors start in its layer's state tuple (kv rows, gate rows[, Ca kv, Ca gate])."""

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float,
                 states: int) -> None:
        super().__init__()
        channels = 2 * width if overlap else width
        self.wkv = nn.Linear(hidden, channels, bias=False)
        self.wgate = nn.Linear(hidden, channels, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, channels))
        self.norm = V4Norm(width, eps)
        self.width, self.rate, self.overlap, self.states = width, rate, overlap, states

    def forward(self, h: torch.Tensor, run: StateRun, start: int, rope: Rope
                ) -> tuple[int, torch.Tensor]:
        """The run's tokens h [n, hidden] (the request's tokens from position `start`) ->
        (index of the first entry they close, the entries [m, width]); moves the run's live
        state and fills its checkpoints."""
        rate, width, i = self.rate, self.width, self.states
        kv, gate = self.wkv(h), self.wgate(h)
        fill = start % rate  # the unfinished window's tokens before this step
        live = run.live
        seq_kv = torch.cat([live[i][:fill].to(kv.dtype), kv])  # from a window boundary
        seq_gate = torch.cat([live[i + 1][:fill].to(gate.dtype), gate])
        first = start // rate  # the window seq starts with
        closed = seq_kv.shape[0] // rate
        channels = seq_kv.shape[-1]
        win_kv = seq_kv[:closed * rate].view(closed, rate, channels)
        win_gate = seq_gate[:closed * rate].view(closed, rate, channels) + self.ape
        prior = (live[i + 2].clone(), live[i + 3].clone()) if self.overlap else None
        for offset, saved in run.saves:
            self._checkpoint(saved, start + offset, first, seq_kv, seq_gate, win_kv,
                             win_gate, prior)
        rest = seq_kv.shape[0] - closed * rate
        live[i][:rest] = seq_kv[closed * rate:].to(live[i].dtype)
        live[i + 1][:rest] = seq_gate[closed * rate:].to(live[i + 1].dtype)
        if closed == 0:
            return first, kv.new_zeros(0, width)
        if self.overlap:
            assert prior is not None
            live[i + 2].copy_(win_kv[-1, :, :width])
            live[i + 3].copy_(win_gate[-1, :, :width])
            win_kv, win_gate = self._pair_windows(win_kv, win_gate, first, prior)
        weights = win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
        pooled = self.norm((win_kv * weights).sum(dim=1))  # [closed, width]
        positions = (first + torch.arange(closed, device=h.device)) * rate
        return first, rope(pooled[:, None], positions)[:, 0]

    def _pair_windows(self, win_kv: torch.Tensor, win_gate: torch.Tensor, first: int,
                      prior: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """[closed, rate, 2 width] -> [closed, 2 rate, width]: each window's slots are the
        previous window's Ca, then its own Cb."""
        rate, width = self.rate, self.width
        closed = win_kv.shape[0]
        kv = win_kv.new_zeros(closed, 2 * rate, width)
        gate = win_gate.new_full((closed, 2 * rate, width), float("-inf"))
        kv[:, rate:], gate[:, rate:] = win_kv[..., width:], win_gate[..., width:]
        kv[1:, :rate], gate[1:, :rate] = win_kv[:-1, :, :width], win_gate[:-1, :, :width]
        if first > 0:  # window 0 has no previous window: its slots keep weight 0
            kv[0, :rate] = prior[0].to(kv.dtype)
            gate[0, :rate] = prior[1].to(gate.dtype)
        return kv, gate

    def _checkpoint(self, saved: tuple[torch.Tensor, ...], position: int, first: int,
                    seq_kv: torch.Tensor, seq_gate: torch.Tensor, win_kv: torch.Tensor,
                    win_gate: torch.Tensor,
                    prior: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The state after the tokens before `position`, into a checkpoint's tensors."""
        i, rate = self.states, self.rate
        begin = position // rate * rate - first * rate  # the unfinished window's rows in seq
        fill = position % rate
        saved[i][:fill] = seq_kv[begin:begin + fill].to(saved[i].dtype)
        saved[i + 1][:fill] = seq_gate[begin:begin + fill].to(saved[i + 1].dtype)
        if prior is None:
            return
        last = position // rate - 1 - first  # the last closed window, in win_*
        if last >= 0:
            saved[i + 2].copy_(win_kv[last, :, :self.width])
            saved[i + 3].copy_(win_gate[last, :, :self.width])
        else:
            saved[i + 2].copy_(prior[0])
            saved[i + 3].copy_(prior[1])
