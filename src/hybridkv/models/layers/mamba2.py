"""The Mamba2 mixer with its state in the KV cache arena.

Each request owns one state block of its group: a conv state `[conv_dim, kernel - 1]` (the
last inputs of the causal depthwise convolution) and an SSM state `[heads, head_dim, state]`.
A step reads them when the request has computed tokens before (chunked prefill, decode),
starts from zeros otherwise (a fresh or recomputed request), and writes them back.

The scan is the chunked SSD form (layers/ssd.py) of the recurrence
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t,   y_t = h_t . C_t + D * x_t
with chunk edges at every checkpoint offset, so snapshots are exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.layers.norms import GatedRMSNorm
from hybridkv.models.layers.ssd import ssd_scan
from hybridkv.models.layers.state import Saves, causal_conv, request_states
from hybridkv.worker import cpu_ops
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.state import StateMetadata

SCAN_CHUNK = 64  # tokens per chunk of the SSD scan (see Mamba2Mixer.__init__)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        self.name = f"model.layers.{layer}.mamba"
        self.native_ops = False  # decode steps and prompts in C (cpu_ops.py)
        hidden = int(cfg["hidden_size"])
        self.num_heads = int(cfg.get("mamba_num_heads") or cfg["mamba_n_heads"])
        self.head_dim = int(cfg.get("mamba_head_dim") or cfg["mamba_d_head"])
        self.state_size = int(cfg.get("ssm_state_size") or cfg["mamba_d_state"])
        self.n_groups = int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 1)
        self.kernel = int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4)
        self.inner = int(cfg.get("mamba_d_ssm") or self.num_heads * self.head_dim)
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        limit = cfg.get("time_step_limit")
        self.time_step_min = float(limit[0] if limit else cfg.get("time_step_min", 0.0))
        # The scan's chunks change no value beyond float rounding (ssd.py), so their length
        # is ours to pick, not the checkpoint's `chunk_size` (128-256, sized for GPU
        # kernels): within a chunk the work per token grows with its length (a [heads, m, m]
        # decay and its exp), across chunks it does not, and 64 tokens ran 1.3-2.5x faster
        # than 128 or 256 on one CPU core at Nemotron-H's and Mamba2's shapes.
        self.chunk_size = min(SCAN_CHUNK, int(cfg.get("chunk_size") or
                                              cfg.get("mamba_chunk_size") or SCAN_CHUNK))
        use_bias = bool(cfg.get("use_bias", cfg.get("mamba_proj_bias", False)))
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_dim + self.num_heads,
                                 bias=use_bias)
        conv_bias = cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel,
                                groups=self.conv_dim, bias=bool(conv_bias))
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        eps = cfg.get("layer_norm_epsilon") or cfg.get("rms_norm_eps") or 1e-5
        # Falcon-H1 may leave the norm out (then y * silu(z)) or normalise before gating.
        self.norm = GatedRMSNorm(
            self.inner, self.inner // self.n_groups, float(eps),
            norm_before_gate=bool(cfg.get("mamba_norm_before_gate", False))
        ) if cfg.get("mamba_rms_norm", True) else None
        self.out_proj = nn.Linear(self.inner, hidden,
                                  bias=bool(cfg.get("projectors_bias", use_bias)))
        # µP (Falcon-H1): a multiplier on the input and one per section of the projection.
        self.in_multiplier = float(cfg.get("ssm_in_multiplier", 1.0))
        sections = cfg.get("ssm_multipliers")
        mup = None
        if sections:
            gn = self.n_groups * self.state_size
            sizes = [self.inner, self.inner, gn, gn, self.num_heads]  # z, x, B, C, dt
            mup = torch.cat([torch.full((n,), float(m))
                             for n, m in zip(sizes, sections, strict=True)])
        self.mup: torch.Tensor | None
        self.register_buffer("mup", mup, persistent=False)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # `positions` unused: the state carries them; the call is the same as attention's.
        meta, states = ctx.state(self.name)
        # h [T, hidden] -> gate [T, inner], xBC [T, conv_dim], dt [T, heads]
        projected = self.in_proj(h * self.in_multiplier if self.in_multiplier != 1.0 else h)
        if self.mup is not None:
            projected = projected * self.mup
        gate, xbc, dt = projected.split([self.inner, self.conv_dim, self.num_heads], -1)
        y = torch.empty(h.shape[0], self.inner, dtype=h.dtype, device=h.device)
        batched = meta.plain_steps
        if batched:
            tokens = meta.plain_step_tokens(h.device)
            y[tokens] = self._decode_batch(xbc[tokens], dt[tokens], meta, batched, states)
        for start, end, conv_state, ssm_state, saves in request_states(meta, states,
                                                                        skip=batched):
            y[start:end] = self._request(xbc[start:end], dt[start:end], conv_state, ssm_state,
                                         saves)
        if self.norm is None:
            return self.out_proj(y * nn.functional.silu(gate))
        return self.out_proj(self.norm(y, gate))

    def _decode_batch(self, xbc: torch.Tensor, dt: torch.Tensor, meta: StateMetadata,
                      rows: list[int], states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One token for each of `rows`, all at once: xbc [R, conv_dim], dt [R, heads]."""
        conv_states, ssm_states = states
        pages = torch.tensor([meta.state_pages[r] for r in rows], device=xbc.device)
        slots = torch.tensor([meta.state_slots[r] for r in rows], device=xbc.device)
        if self.native_ops and cpu_ops.takes(xbc) and cpu_ops.takes(dt) and \
                cpu_ops.decode_states_take(conv_states, ssm_states):
            # The whole step below in one C call, both states updated in place.
            return cpu_ops.mamba2_decode(
                conv_states, ssm_states, pages, slots, xbc, dt, self.conv1d.weight,
                self.conv1d.bias, self.dt_bias, -torch.exp(self.A_log.float()), self.D,
                self.n_groups)
        window = torch.cat([conv_states[pages, slots].to(xbc.dtype), xbc[:, :, None]], -1)
        conv_states[pages, slots] = window[:, :, 1:].to(conv_states.dtype)
        conv = (window * self.conv1d.weight[:, 0, :]).sum(-1)  # [R, conv_dim]
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        x, b, c = nn.functional.silu(conv).split(
            [self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size], -1)
        num, groups = x.shape[0], self.n_groups
        per_group = self.num_heads // groups
        dt = nn.functional.softplus(dt.float() + self.dt_bias.float())  # [R, heads]
        x = x.float().view(num, self.num_heads, self.head_dim)
        b = b.float().view(num, groups, 1, 1, self.state_size)
        c = c.float().view(num, groups, 1, self.state_size, 1)
        a = -torch.exp(self.A_log.float())
        # The gathered states [R, heads, head_dim, state] are a copy: updated in place there
        # (an outer product broadcast into addcmul_, not materialised), then scattered
        # back. B and C broadcast over their group's heads.
        state = ssm_states[pages, slots].float()
        state.mul_(torch.exp(dt * a)[:, :, None, None])
        grouped = state.view(num, groups, per_group, self.head_dim, self.state_size)
        grouped.addcmul_((dt[:, :, None] * x).view(num, groups, per_group, self.head_dim, 1), b)
        ssm_states[pages, slots] = state.to(ssm_states.dtype)
        out = torch.matmul(grouped, c).view(num, self.num_heads, self.head_dim)  # state . C
        out = out + x * self.D.float()[None, :, None]
        return out.flatten(1).to(xbc.dtype)

    def _request(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor,
                 ssm_state: torch.Tensor, saves: Saves) -> torch.Tensor:
        """One request's tokens; updates its conv and SSM states in place, and writes the
        states after `offset` tokens into each checkpoint of `saves`."""
        num_tokens = xbc.shape[0]
        save_at = {offset: ssm for offset, _, ssm in saves}
        if self.native_ops and cpu_ops.takes(xbc) and cpu_ops.takes(dt):
            # Conv, activations, scan and skip in two C calls, where the torch code below
            # runs ~25 ops a request (models/layers/ssd.py's scan stays the reference).
            # States of another dtype (--state-dtype bf16) go through float32 copies, as
            # the torch code computes them.
            conv_live, ssm_live = (s if cpu_ops.takes_state(s) else s.float().contiguous()
                                   for s in (conv_state, ssm_state))
            conv = cpu_ops.causal_conv(xbc, conv_live, self.conv1d.weight, self.conv1d.bias,
                                       {offset: c for offset, c, _ in saves}, silu=True)
            y = cpu_ops.mamba2_scan(
                conv, dt, self.dt_bias, -torch.exp(self.A_log.float()), self.D,
                self.time_step_min if num_tokens > 1 else None, ssm_live, self.n_groups,
                save_at)
            for live, state in ((conv_live, conv_state), (ssm_live, ssm_state)):
                if live is not state:
                    state.copy_(live)
            return y
        conv = causal_conv(xbc, conv_state, self.conv1d, saves)  # [L, conv_dim]
        x, b, c = nn.functional.silu(conv).split(
            [self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size], -1)
        dt = nn.functional.softplus(dt.float() + self.dt_bias.float())  # [L, heads]
        if num_tokens > 1:
            # The reference clamps dt in its multi-token scan only (not in single steps).
            dt = dt.clamp(min=self.time_step_min)
        a = -torch.exp(self.A_log.float())  # [heads]
        x = x.float().view(num_tokens, self.num_heads, self.head_dim)
        b = b.float().view(num_tokens, self.n_groups, self.state_size)  # [L, groups, state]
        c = c.float().view(num_tokens, self.n_groups, self.state_size)
        out, state = ssd_scan(x, dt, a, b, c, ssm_state.float(), chunk_size=self.chunk_size,
                              save_at=save_at)
        ssm_state.copy_(state.to(ssm_state.dtype))
        out = out + x * self.D.float()[None, :, None]
        return out.flatten(1).to(xbc.dtype)
