"""Modules over weights kept quantized (GGUF blocks): a linear layer and an embedding table.

They stand where a model's `nn.Linear` / `nn.Embedding` stood, so the families are unchanged;
`Linear` (worker/linear/layers.py) fuses several of them (q/k/v, gate/up) into one call when their
block types agree. The kernels are worker/linear/quant.py's C code: weights are read in their
blocks at every step, never expanded to float32 in memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridkv.worker.linear.quant import QuantizedWeight


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


class QuantizedParts(nn.Module):
    """Several quantized maps of one input side by side (q/k/v; gate/up), each kept where it
    lies (a mapped GGUF's pages, shared by every process that maps the file: a copy side by
    side would be memory of this process's own). Each part writes its columns of one output;
    a row's sums do not depend on the matrix around it, so the bytes are those of one call
    on the rows stacked."""

    def __init__(self, linears: Sequence[QuantizedLinear]) -> None:
        super().__init__()
        self.weights = [lin.qweight for lin in linears]
        biases = [lin.bias for lin in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat([
            b.detach() if b is not None else torch.zeros(lin.out_features)
            for b, lin in zip(biases, linears, strict=True)])
        self.in_features = linears[0].in_features
        self.out_features = sum(lin.out_features for lin in linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if len(self.weights) == 1:
            y = self.weights[0].matmul(rows)
        else:
            y = torch.empty((rows.shape[0], self.out_features), dtype=torch.float32)
            start = 0
            for w in self.weights:
                w.matmul(rows, out=y[:, start:start + w.rows])
                start += w.rows
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)
