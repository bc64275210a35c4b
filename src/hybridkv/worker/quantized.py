"""Modules over weights kept quantized (GGUF blocks): a linear layer and an embedding table.

They stand where a model's `nn.Linear` / `nn.Embedding` stood, so the families are unchanged;
`Linear` (worker/linear.py) fuses several of them (q/k/v, gate/up) into one call when their
block types agree. The kernels are worker/quant_linear.py's C code: weights are read in their
blocks at every step, never expanded to float32 in memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridkv.worker.quant_linear import QuantizedWeight


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias), W held as GGUF blocks ([out_features] rows of in_features)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.cols, weight.rows
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.qweight.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qweight.qtype}, bias={self.bias is not None}")


class QuantizedEmbedding(nn.Module):
    """Rows of a quantized table, dequantized only for the ids looked up."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        return self.qweight.rows_of(flat).reshape(*ids.shape, self.embedding_dim)


def concat(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Matrices of one block type and width stacked by rows."""
    if len(weights) == 1:
        return weights[0]
    first = weights[0]
    assert all(w.qtype == first.qtype and w.cols == first.cols for w in weights)
    return QuantizedWeight(torch.cat([w.data for w in weights]), first.qtype,
                           sum(w.rows for w in weights), first.cols)


class QuantizedParts(nn.Module):
    """Several quantized maps of one input side by side (q/k/v; gate/up): consecutive maps
    of one block type become one matrix (their rows concatenated: GGUF blocks never cross a
    row), so a layer whose q, k and v share a type is one kernel call."""

    def __init__(self, linears: Sequence[QuantizedLinear]) -> None:
        super().__init__()
        parts: list[list[QuantizedLinear]] = []
        for lin in linears:
            if parts and parts[-1][-1].qweight.qtype == lin.qweight.qtype:
                parts[-1].append(lin)
            else:
                parts.append([lin])
        self.weights = [concat([p.qweight for p in run]) for run in parts]
        biases = [lin.bias for lin in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat([
            b.detach() if b is not None else torch.zeros(lin.out_features)
            for b, lin in zip(biases, linears, strict=True)])
        self.in_features = linears[0].in_features
        self.out_features = sum(lin.out_features for lin in linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        outs = [w.matmul(rows) for w in self.weights]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)
