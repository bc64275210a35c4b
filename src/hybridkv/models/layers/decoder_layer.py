"""The pre-norm residual decoder layer most families use, with its parts named as each
checkpoint names them:

    h = h + [post_mixer_norm](mixer(mixer_norm(h), positions, ctx)) * residual_multiplier
    h = h + [post_ffn_norm](sum of ffns(ffn_norm(h)))               * residual_multiplier

The mixer is attention or a state mixer (same call); either sublayer may be absent
(NemotronH layers hold one of them). Sandwich norms (`post_*`) are Gemma 2/3's; the
residual multiplier is Granite's µP factor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.models.layers.attention import Attention
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.worker.forward_context import ForwardContext


@dataclass(frozen=True)
class LayerNames:
    """Checkpoint names of a layer's parts; None where the layer has no such part."""

    mixer: str | None
    mixer_norm: str | None = "input_layernorm"
    ffn_norm: str | None = "post_attention_layernorm"
    ffns: tuple[str, ...] = ("mlp",)
    post_mixer_norm: str | None = None
    post_ffn_norm: str | None = None


class DecoderLayer(nn.Module):
    def __init__(self, names: LayerNames, mixer: nn.Module | None, ffns: Sequence[nn.Module],
                 hidden: int, eps: float, *, norm_offset: float = 0.0,
                 residual_multiplier: float = 1.0,
                 norm: Callable[[int, float], nn.Module] | None = None) -> None:
        """`norm(hidden, eps)`: the norm module where it is not RMSNorm (StarCoder 2's
        LayerNorm)."""
        super().__init__()
        self.names, self.residual_multiplier = names, residual_multiplier
        if names.mixer is not None:
            self.add_module(names.mixer, mixer)
        for name, ffn in zip(names.ffns, ffns, strict=True):
            self.add_module(name, ffn)
        for norm_name in (names.mixer_norm, names.post_mixer_norm, names.ffn_norm,
                          names.post_ffn_norm):
            if norm_name is not None:
                self.add_module(norm_name, RMSNorm(hidden, eps, norm_offset) if norm is None
                                else norm(hidden, eps))

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        n = self.names
        if n.mixer is not None:
            x = getattr(self, n.mixer)(self._norm(n.mixer_norm, h), positions, ctx)
            h = h + self._out(n.post_mixer_norm, x)
        return self._ffn(h)

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        n = self.names
        if n.ffns:
            x = self._norm(n.ffn_norm, h)
            y = getattr(self, n.ffns[0])(x)
            for name in n.ffns[1:]:
                y = y + getattr(self, name)(x)
            h = h + self._out(n.post_ffn_norm, y)
        return h

    @property
    def rows_only(self) -> bool:
        """Whether each row's output depends on that row alone (no mixer: NemotronH's MLP
        layers), so the layer may run on any subset of the rows."""
        return type(self) is DecoderLayer and self.names.mixer is None

    @property
    def cuts_rows(self) -> bool:
        """Whether `forward_rows` may run: a plain attention mixer, nothing else per row."""
        mixer = getattr(self, self.names.mixer) if self.names.mixer is not None else None
        return type(self) is DecoderLayer and isinstance(mixer, Attention) and mixer.cuts_rows

    def forward_rows(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
                     ) -> torch.Tensor | None:
        """`forward(h, positions, ctx)` at the step's sampled rows only, with every token's
        K/V written (a model's last layer, where nothing reads the other rows); None where
        the step or the layer's group does not allow it (see ForwardContext.cut_to_sampled)."""
        n = self.names
        assert n.mixer is not None
        cut = ctx.cut_to_sampled(getattr(self, n.mixer).name)
        if cut is None:
            return None
        rows_ctx, rows = cut
        x = getattr(self, n.mixer).forward_rows(self._norm(n.mixer_norm, h), positions, ctx,
                                                rows, rows_ctx)
        if x is None:  # no row samples (a prompt chunk before its last): K/V was all
            return h[rows]
        return self._ffn(h[rows] + self._out(n.post_mixer_norm, x))

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        return x if name is None else getattr(self, name)(x)  # type: ignore[no-any-return]

    def _out(self, post_norm: str | None, x: torch.Tensor) -> torch.Tensor:
        x = self._norm(post_norm, x)
        return x * self.residual_multiplier if self.residual_multiplier != 1.0 else x
