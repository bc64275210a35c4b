"""A greedy step's argmax over a large vocabulary from an 8-bit pre-pass of the LM head,
exact: every token the pre-pass cannot rule out is scored again at full precision.

At a 262k x 640 head the logits are most of a small model's step: 671 MB of float32 rows
read at batch 1, 10.7 GFLOP at batch 32. The pre-pass reads 8-bit rows (a Q8_0 copy of a
float head, or a quantized head's own blocks) and quantizes x to 8 bits per 32 values
(worker/quant_linear.py's integer kernel), then bounds each logit's error:

    |approx - exact| <= ||e|| ||w_hat_v|| + ||x|| ||w_v - w_hat_v|| + float rounding

(Cauchy-Schwarz on exact = x . w_v against approx = x_hat . w_hat_v; e = x - x_hat, which
is computed here exactly as the kernel rounds it). The argmax's logit is at least the
largest lower end; tokens whose upper end falls short of it are out, and the rest (tens
to a few thousand of 262,144 on Gemma 3 270M) get their exact logits from their float (or
dequantized) head rows. The token is the exact argmax of those, the first id among equal
values, as torch.argmax takes it: the same token as the full logits give, up to float
rounding of the exact sums (~1e-6), as any two GEMMs differ.

Used for plain greedy rows on CPUs where the integer kernel runs (AVX2); the head's
multiplier and soft cap, both increasing, are applied to the exact values afterwards.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridkv.worker import native, quant_linear
from hybridkv.worker.head_topk import HeadCandidates

Q8_0 = 8
# Quantized heads whose rows are d * q (no min): the kernel's error then depends on the
# row's own values only, which the bound uses. Heads with a min (Q4_1, Q4_K, ...) get no
# pre-pass.
_SIGNED_TYPES = (2, 6, 8, 14)  # Q4_0, Q5_0, Q8_0, Q6_K
# Float rounding of the integer kernel's scaled block sums and of the exact dot products:
# each within cols * 2^-24 * ||x|| ||w|| (Cauchy-Schwarz on |x|, |w|); twice that, twice.
_ROUNDING = 4 * 2.0 ** -24
_CAP = 4096  # candidates per row the first selection makes room for
MAX_K = 64  # the most candidates a row may ask for (head_bound.c keeps them on its stack)
_ROWS = 2048  # weight rows quantized or measured at a time at load


@dataclass
class HeadBound:
    """The pre-pass weights of a head and what the bound needs of each vocabulary row."""

    data: torch.Tensor  # uint8 [vocab, row_bytes]: rows in `qtype` blocks
    qtype: int
    cols: int
    wnorm: torch.Tensor  # float32 [vocab]: ||w_hat_v||
    dnorm: torch.Tensor | None  # float32 [vocab]: ||w_v - w_hat_v||; None: w_hat is w
    exact_rows: Callable[[torch.Tensor], torch.Tensor]  # ids -> float32 [n, cols]
    int_rows: int  # x rows per integer-kernel call

    @property
    def vocab(self) -> int:
        return int(self.data.shape[0])

    @classmethod
    def of_quantized(cls, weight: quant_linear.QuantizedWeight) -> HeadBound | None:
        """A quantized head read by the pre-pass as it is (None: a type with a min, no
        integer kernel here, or rows that are not finite, whose NaN logits the full path
        reports)."""
        rows = _int_rows(weight.qtype)
        if weight.qtype not in _SIGNED_TYPES or not rows:
            return None
        norms = torch.empty(weight.rows, dtype=torch.float32)
        for r0 in range(0, weight.rows, _ROWS):
            chunk = quant_linear.dequantize(weight.data[r0:r0 + _ROWS], weight.qtype,
                                            weight.cols)
            torch.linalg.vector_norm(chunk, dim=1, out=norms[r0:r0 + chunk.shape[0]])
        if not bool(torch.isfinite(norms).all()):
            return None
        return cls(weight.data, weight.qtype, weight.cols, norms, None, weight.rows_of, rows)

    @classmethod
    def of_float(cls, weight: torch.Tensor) -> HeadBound | None:
        """A float32 head [vocab, cols] with a Q8_0 copy for the pre-pass (a quarter of
        its bytes); None where cols is not a multiple of 32 or there is no integer kernel.
        The exact rows are gathered from `weight`, which must stay as it is."""
        rows = _int_rows(Q8_0)
        vocab, cols = weight.shape
        if not rows or cols % 32 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        weight = weight.detach()
        data = torch.empty((vocab, cols // 32 * 34), dtype=torch.uint8)
        wnorm = torch.empty(vocab, dtype=torch.float32)
        dnorm = torch.empty(vocab, dtype=torch.float32)
        for r0 in range(0, vocab, _ROWS):
            w = weight[r0:r0 + _ROWS]
            n = w.shape[0]
            blocks, approx = quantize_q8_0(w)
            data[r0:r0 + n] = blocks
            torch.linalg.vector_norm(approx, dim=1, out=wnorm[r0:r0 + n])
            torch.linalg.vector_norm(w - approx, dim=1, out=dnorm[r0:r0 + n])

        if not (bool(torch.isfinite(wnorm).all()) and bool(torch.isfinite(dnorm).all())):
            return None  # rows beyond float16 scales (|w| > ~8e6): no Q8_0 copy

        def exact_rows(ids: torch.Tensor) -> torch.Tensor:
            return weight.index_select(0, ids)

        return cls(data, Q8_0, cols, wnorm, dnorm, exact_rows, rows)

    def approx(self, x: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32: the pre-pass logits (no multiplier or cap)."""
        lib = quant_linear.library()
        n = x.shape[0]
        out = torch.empty((n, self.vocab), dtype=torch.float32)
        for i in range(0, n, self.int_rows):
            m = min(self.int_rows, n - i)
            rc = lib.hkv_quant_matmul_int8(x[i].data_ptr(), m, x.stride(0),
                                           self.data.data_ptr(), self.data.stride(0),
                                           self.qtype, self.vocab, self.cols,
                                           out[i].data_ptr(), out.stride(0))
            if rc != 0:
                raise MemoryError("the LM head's pre-pass could not allocate its buffers")
        return out

    def error_terms(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b), float32 [N]: row r's pre-pass logit of token v is within
        a[r] wnorm[v] + b[r] dnorm[v] of its exact logit (b unused without dnorm)."""
        xnorm = torch.linalg.vector_norm(x, dim=1)
        enorm = torch.linalg.vector_norm(x - quantized_x(x), dim=1)
        slack = _ROUNDING * self.cols * (xnorm + enorm)
        return (enorm + slack).contiguous(), (xnorm + slack).contiguous()

    def candidates(self, x: torch.Tensor, approx: torch.Tensor, k: int = 1
                   ) -> list[torch.Tensor]:
        """Each row's tokens that can be among its k largest logits (k = 1: its argmax),
        ascending (int64): those whose upper end reaches the k-th largest lower end."""
        if not 1 <= k <= MAX_K:
            raise ValueError(f"k must be in [1, {MAX_K}], not {k}")
        n = x.shape[0]
        a, b = self.error_terms(x)
        fn = _select()
        cap = max(_CAP, k)
        while True:
            ids = torch.empty((n, cap), dtype=torch.int64)
            counts = torch.empty(n, dtype=torch.int64)
            fn(approx.data_ptr(), n, self.vocab, approx.stride(0), a.data_ptr(), b.data_ptr(),
               self.wnorm.data_ptr(),
               None if self.dnorm is None else self.dnorm.data_ptr(),
               k, cap, ids.data_ptr(), counts.data_ptr())
            most = int(counts.max())
            if most <= cap:
                break
            cap = most
        return [ids[r, :int(c)] for r, c in enumerate(counts.tolist())]

    def top(self, x: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [N, k] int64, exact logits [N, k] float32): each row's k largest logits,
        descending, among equal values the lower id first (k = 1: torch.argmax's token);
        -1 / -inf past the vocabulary. None where a row of x is not finite (the caller's
        full logits handle NaN as torch does)."""
        if x.dim() != 2 or x.shape[1] != self.cols or x.dtype != torch.float32:
            return None
        if not bool(torch.isfinite(x).all()):
            return None
        x = x.contiguous()
        found = self.candidates(x, self.approx(x), k)
        if any(len(cand) == 0 for cand in found):
            return None  # a bound that is not finite (a head with NaN rows): the full path
        ids = torch.full((x.shape[0], k), -1, dtype=torch.int64)
        values = torch.full((x.shape[0], k), float("-inf"), dtype=torch.float32)
        for r, cand in enumerate(found):
            # Each row summed alike (a GEMV may sum rows in different orders by position):
            # equal head rows give equal logits, and the first id wins, as in the full path.
            exact = (self.exact_rows(cand) * x[r]).sum(dim=1)
            if k == 1:
                j = int(torch.argmax(exact))
                ids[r, 0], values[r, 0] = cand[j], exact[j]
                continue
            order = torch.sort(exact, descending=True, stable=True).indices[:k]
            ids[r, :len(order)], values[r, :len(order)] = cand[order], exact[order]
        return ids, values

    def head_candidates(self, x: torch.Tensor, k: int,
                        scale: Callable[[torch.Tensor], torch.Tensor]) -> HeadCandidates | None:
        """top() as head candidates, the values passed through `scale` (the head's
        multiplier and soft cap)."""
        found = self.top(x, k)
        if found is None:
            return None
        ids, values = found
        return HeadCandidates(scale(values), ids, torch.zeros(ids.shape[0], dtype=torch.bool))


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the integer kernel reads it: per 32 values d = max|x| / 127, round(x / d) d,
    with x / d taken as x * (1 / d) and rounded to nearest even, as the kernel does."""
    n, cols = x.shape
    blocks = x.view(n, cols // 32, 32)
    d = blocks.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).view(n, cols)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [n, cols] (cols a multiple of 32) -> (Q8_0 blocks uint8 [n, cols / 32 * 34],
    the values they hold as float32 [n, cols]): per 32 values an fp16 scale max|w| / 127
    and 32 int8 values, round(w / scale)."""
    n, cols = w.shape
    blocks = w.reshape(n, cols // 32, 32)
    d = (blocks.abs().amax(dim=2, keepdim=True) / 127.0).to(torch.float16)
    df = d.to(torch.float32)
    inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round(blocks * inv).clamp_(-127, 127)
    out = torch.empty((n, cols // 32, 34), dtype=torch.uint8)
    out[:, :, :2] = d.view(torch.uint8).view(n, cols // 32, 2)
    out[:, :, 2:] = q.to(torch.int8).view(torch.uint8)
    return out.view(n, -1), (q * df).view(n, cols)


def _int_rows(qtype: int) -> int:
    """x rows per integer-kernel call for `qtype` here (0: no integer kernel)."""
    if not quant_linear.available():
        return 0
    return int(quant_linear.library().hkv_quant_int8_rows_max(int(qtype)))


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# approx, n, vocab, ld, a, b, wnorm, dnorm, k, cap, ids, counts
_SELECT_ARGS = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR]


def _select() -> Callable[..., None]:
    fn = native.function("head_bound", "hkv_head_bound_select", _SELECT_ARGS)
    if fn is None:
        raise native.NativeBuildError("worker/native/head_bound.c does not build here")
    return fn  # type: ignore[no-any-return]
