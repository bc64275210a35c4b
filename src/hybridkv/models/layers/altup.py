"""AltUp (Gemma 3n): the layers keep `num_inputs` copies of the hidden state; each layer runs
on one ("active") copy predicted from all of them, then corrects every copy with its output.
Hidden states are [copies, tokens, hidden]."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.layers.norms import RMSNorm


class AltUp(nn.Module):
    def __init__(self, hidden: int, num_inputs: int, active: int, eps: float) -> None:
        super().__init__()
        self.num_inputs, self.active, self.hidden = num_inputs, active, hidden
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correction_coefs = nn.Linear(num_inputs, num_inputs, bias=False)
        self.prediction_coefs = nn.Linear(num_inputs, num_inputs ** 2, bias=False)
        self.modality_router = nn.Linear(hidden, num_inputs, bias=False)
        self.router_norm = RMSNorm(hidden, eps)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * (1.0 / self.hidden))
        return torch.tanh(routed.float()).to(x.dtype)  # [T, A]

    def predict(self, hs: torch.Tensor) -> torch.Tensor:
        """hs [A, T, H] -> predictions [A, T, H]: each copy plus a per-token mix of all."""
        coefs = self.prediction_coefs(self._modalities(hs[self.active]))
        coefs = coefs.unflatten(-1, (self.num_inputs, self.num_inputs)).transpose(1, 2)
        mixed = torch.matmul(hs.permute(1, 2, 0), coefs)  # [T, H, A]
        return mixed.permute(2, 0, 1) + hs

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """Spread the active copy's innovation (layer output - its prediction) to all."""
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0  # [T, A]
        innovation = activated - predictions[self.active]
        return innovation.unsqueeze(0) * coefs.T.unsqueeze(-1) + predictions


def expand(h: torch.Tensor, projections: nn.ModuleList) -> torch.Tensor:
    """The embedding [T, H] -> copies [A, T, H]: itself and each projection of it, scaled to
    its magnitude."""
    target = torch.mean(h ** 2, dim=-1, keepdim=True) ** 0.5
    return torch.stack([h, *(_match_magnitude(proj(h), target) for proj in projections)])


def collapse(hs: torch.Tensor, unembed_projections: nn.ModuleList) -> torch.Tensor:
    """Copies [A, T, H] -> [T, H]: the mean of the first and the others projected back, each
    scaled to the first's magnitude."""
    target = torch.mean(hs[0] ** 2, dim=-1, keepdim=True) ** 0.5
    outs = [hs[0], *(_match_magnitude(proj(hs[j + 1]), target)
                     for j, proj in enumerate(unembed_projections))]
    return torch.stack(outs).mean(dim=0)


def _match_magnitude(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    magnitude = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * target / magnitude
