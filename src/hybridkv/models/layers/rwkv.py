"""An RWKV-4 block: time mixing (the WKV recurrence) then channel mixing, each fed the
token's normalised input blended with the previous token's ("token shift"). Its whole
per-request state lives in the KV cache arena as two tensors:

    shift [2, hidden]          the last ln1 input (time mix) and ln2 input (channel mix)
    wkv   [3, attention_hidden] float32: numerator, denominator and running max exponent

    time mix:    r, k, v = sigmoid(R mix_r(x)), K mix_k(x), V mix_v(x)
                 mix_*(x_t) = x_t * mu + x_{t-1} * (1 - mu)
                 wkv_t = (num + e^{u + k_t} v_t) / (den + e^{u + k_t})        (stabilised by max)
                 num <- e^{-e^w} num + e^{k_t} v_t,   den <- e^{-e^w} den + e^{k_t}
                 out = O (r * wkv)
    channel mix: out = sigmoid(R mix_r(x)) * V relu(K mix_k(x))^2

A fresh state is all zeros; a zero denominator marks it (after one token it is >= 1), and the
running max is then taken as minus infinity, as the reference's initial -1e30 does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridkv.models.layers.state import Saves, request_states, state_places
from hybridkv.worker.forward_context import ForwardContext

Scan = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mix(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    mu = weight.view(-1)
    return x * mu + prev * (1 - mu)  # type: ignore[no-any-return]


def wkv_step(k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, decay: torch.Tensor,
             first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: k, v [..., A] (float32), state [..., 3, A] -> (wkv [..., A], new state)."""
    num, den, top = state.unbind(-2)
    peak = torch.maximum(top, k + first)
    e1, e2 = torch.exp(top - peak), torch.exp(k + first - peak)
    out = (e1 * num + e2 * v) / (e1 * den + e2)
    peak = torch.maximum(top + decay, k)
    e1, e2 = torch.exp(top + decay - peak), torch.exp(k - peak)
    return out, torch.stack([e1 * num + e2 * v, e1 * den + e2, peak], dim=-2)


def fresh_max(state: torch.Tensor) -> torch.Tensor:
    """The state [..., 3, A] with the max of never-used states (zero denominator) at -1e38."""
    num, den, top = state.unbind(-2)
    return torch.stack([num, den, torch.where(den == 0, -1e38, top)], dim=-2)


class TimeMix(nn.Module):
    def __init__(self, hidden: int, attention_hidden: int) -> None:
        super().__init__()
        self.time_decay = nn.Parameter(torch.zeros(attention_hidden))
        self.time_first = nn.Parameter(torch.zeros(attention_hidden))
        self.time_mix_key = nn.Parameter(torch.zeros(1, 1, hidden))
        self.time_mix_value = nn.Parameter(torch.zeros(1, 1, hidden))
        self.time_mix_receptance = nn.Parameter(torch.zeros(1, 1, hidden))
        self.key = nn.Linear(hidden, attention_hidden, bias=False)
        self.value = nn.Linear(hidden, attention_hidden, bias=False)
        self.receptance = nn.Linear(hidden, attention_hidden, bias=False)
        self.output = nn.Linear(attention_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, prev: torch.Tensor, scan: Scan) -> torch.Tensor:
        """x, prev [N, hidden]; `scan(k, v)` runs the WKV over them -> [N, hidden]."""
        k = self.key(mix(x, prev, self.time_mix_key))
        v = self.value(mix(x, prev, self.time_mix_value))
        r = torch.sigmoid(self.receptance(mix(x, prev, self.time_mix_receptance)))
        return self.output(r * scan(k, v).to(r.dtype))  # type: ignore[no-any-return]

    def scan(self, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
             saves: Saves) -> torch.Tensor:
        """One request's tokens k, v [L, A] in order from `state` [3, A], which is updated;
        checkpoints get the state after their offset."""
        decay, first = -torch.exp(self.time_decay.float()), self.time_first.float()
        save_at = {offset: wkv for offset, _, wkv in saves}
        s = fresh_max(state.float())
        if 0 in save_at:
            save_at[0].copy_(state)
        out = torch.empty(k.shape, dtype=torch.float32, device=k.device)
        for t in range(k.shape[0]):
            out[t], s = wkv_step(k[t].float(), v[t].float(), s, decay, first)
            if t + 1 in save_at:
                save_at[t + 1].copy_(s)
        state.copy_(s)
        return out

    def step(self, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """One token for each of R requests: k, v [R, A], states [R, 3, A] updated in place."""
        decay, first = -torch.exp(self.time_decay.float()), self.time_first.float()
        out, new = wkv_step(k.float(), v.float(), fresh_max(states.float()), decay, first)
        states.copy_(new)
        return out


class ChannelMix(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.time_mix_key = nn.Parameter(torch.zeros(1, 1, hidden))
        self.time_mix_receptance = nn.Parameter(torch.zeros(1, 1, hidden))
        self.key = nn.Linear(hidden, intermediate, bias=False)
        self.receptance = nn.Linear(hidden, hidden, bias=False)
        self.value = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        k = torch.square(torch.relu(self.key(mix(x, prev, self.time_mix_key))))
        r = torch.sigmoid(self.receptance(mix(x, prev, self.time_mix_receptance)))
        return r * self.value(k)  # type: ignore[no-any-return]


class RwkvBlock(nn.Module):
    """forward(h [T, hidden], positions [T], ctx) -> h after the block [T, hidden] (the whole
    residual block: the first one also normalises its input, `pre_ln`; with `halve`, the
    output is divided by 2, transformers' inference-time rescaling)."""

    def __init__(self, hidden: int, attention_hidden: int, intermediate: int, eps: float,
                 layer: int, *, halve: bool = False) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"  # the state layer's name in the KV layout
        self.pre_ln = nn.LayerNorm(hidden, eps=eps) if layer == 0 else None
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.attention = TimeMix(hidden, attention_hidden)
        self.feed_forward = ChannelMix(hidden, intermediate)
        self.halve = halve

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, states = ctx.state(self.name)
        if self.pre_ln is not None:
            h = self.pre_ln(h)
        out = torch.empty_like(h)
        rows = meta.plain_steps  # single-token steps: all at once
        if rows:
            tokens = meta.plain_step_tokens(h.device)
            out[tokens] = self._decode_batch(h[tokens], states, *state_places(meta, rows,
                                                                             h.device))
        for start, end, shift, wkv, saves in request_states(meta, states, skip=rows):
            out[start:end] = self._request(h[start:end], shift, wkv, saves)
        return out / 2 if self.halve else out

    def _request(self, h: torch.Tensor, shift: torch.Tensor, wkv: torch.Tensor,
                 saves: Saves) -> torch.Tensor:
        """One request's tokens h [L, hidden] in order; shift [2, hidden] and wkv [3, A]
        are read and updated, and each checkpoint gets both after its offset."""
        # E.g. seq_a = [x_{-1} (from the state), x_0, ..., x_{L-1}]: seq_a[t] precedes token t.
        xa = self.ln1(h)
        seq_a = torch.cat([shift[:1].to(xa.dtype), xa])
        h = h + self.attention(xa, seq_a[:-1],
                               lambda k, v: self.attention.scan(k, v, wkv, saves))
        xf = self.ln2(h)
        seq_f = torch.cat([shift[1:].to(xf.dtype), xf])
        h = h + self.feed_forward(xf, seq_f[:-1])
        for offset, saved_shift, _ in saves:
            saved_shift.copy_(torch.stack([seq_a[offset], seq_f[offset]]))
        shift.copy_(torch.stack([xa[-1], xf[-1]]))
        return h

    def _decode_batch(self, h: torch.Tensor, states: tuple[torch.Tensor, ...],
                      pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each of R requests: h [R, hidden] -> [R, hidden]."""
        shifts, wkvs = states
        shift, wkv = shifts[pages, slots], wkvs[pages, slots]  # [R, 2, hidden], [R, 3, A]
        xa = self.ln1(h)
        h = h + self.attention(xa, shift[:, 0].to(xa.dtype),
                               lambda k, v: self.attention.step(k, v, wkv))
        xf = self.ln2(h)
        h = h + self.feed_forward(xf, shift[:, 1].to(xf.dtype))
        shifts[pages, slots] = torch.stack([xa, xf], dim=1).to(shifts.dtype)
        wkvs[pages, slots] = wkv
        return h
