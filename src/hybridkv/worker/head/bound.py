"""A greedy step's argmax over a large vocabulary from an 8-bit pre-pass of the LM head,
exact: every token the pre-pass cannot rule out is scored again at full precision.

At a 262k x 640 head the logits are most of a small model's step: 671 MB of float32 rows
read at batch 1, 10.7 GFLOP at batch 32. The pre-pass keeps an 8-bit copy of the head
(per 32 values a half-precision scale max|w| / 127 and 32 int8 values; ~27% of a float
head's bytes), packed eight tokens at a time for native/head_bound.c's kernel, which on
an AVX2 core computes it ~2x faster than a float GEMM at 32 rows and reads those bytes at
one row. x is rounded to 8 bits per 32 values alike (with float32 scales). Each logit's error is
bounded:

    |approx - exact| <= sum_b ||e_b|| ||w_hat_v,b|| + ||x_b|| ||w_v,b - w_hat_v,b||
                     <= ||e|| ||w_hat_v|| + ||x|| ||w_v - w_hat_v||        (+ float rounding)

(Cauchy-Schwarz on exact = x . w_v against approx = x_hat . w_hat_v, per 32-value block b
and over the blocks; e = x - x_hat, computed here exactly as the kernel gets it). The
argmax's logit is at least the largest lower end; tokens whose upper end falls short of
it are out. The whole-row bound rules out most of the vocabulary; the block bound, where
x's energy sits in a few blocks far tighter, the rest of what it can: a handful of
tokens on Gemma 3 270M's hidden states (under 800 of 262,144 on the hardest rows seen),
which get their exact logits from the head's own product on their rows (for a quantized
head, the bytes of the full logits: native/quant_gemm.c sums a row alike in any batch).
The token is the exact argmax of those, the first id among equal values, as torch.argmax
takes it: the full logits' token.

Used for plain greedy rows on CPUs with AVX2; the head's multiplier and soft cap, both
increasing, are applied to the exact values afterwards.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.worker import native
from hybridkv.worker.head import cache as head_cache
from hybridkv.worker.head.topk import HeadCandidates
from hybridkv.worker.linear import quant as quant_linear

BLOCK = 32  # values per scale, in the copy and in x
GROUP = 8  # tokens packed together (one register's int32 lanes)
# Float rounding of the kernel's scaled block sums and of the exact dot products: each
# within cols * 2^-24 * ||x|| ||w|| (Cauchy-Schwarz on |x|, |w|); twice that, twice.
_ROUNDING = 4 * 2.0 ** -24
_CAP = 4096  # candidates per row the first selection makes room for
MAX_K = 64  # the most candidates a row may ask for (head_bound.c keeps them on its stack)
MAX_ROWS = 64  # x rows per kernel call: their pre-pass logits are [rows, vocab] floats
_ROWS = 2048  # weight rows quantized and measured at a time at load (a multiple of GROUP)


@dataclass
class ErrorTerms:
    """What row r of x adds to each token's error bound (float32, contiguous)."""

    a: torch.Tensor  # [N]: ||e|| + slack, times ||w_hat_v||
    b: torch.Tensor  # [N]: ||x|| + slack, times ||w_v - w_hat_v||
    eb: torch.Tensor  # [N, blocks]: ||e_b||
    xb: torch.Tensor  # [N, blocks]: ||x_b||
    slack: torch.Tensor  # [N]: float rounding, times ||w_hat_v|| + ||w_v - w_hat_v||


@dataclass
class HeadBound:
    """The pre-pass copy of a head and what the bound needs of each vocabulary row."""

    packed: torch.Tensor  # int8 [groups, blocks, 8, 32]: see native/head_bound.c
    scales: torch.Tensor  # float16 [groups, blocks, 8]
    vocab: int
    cols: int
    wnorm: torch.Tensor  # float32 [vocab]: ||w_hat_v||
    dnorm: torch.Tensor | None  # float32 [vocab]: ||w_v - w_hat_v||; None: w_hat is w
    wblock: torch.Tensor  # float32 [vocab, blocks]: ||w_hat_v,b||
    dblock: torch.Tensor | None  # float32 [vocab, blocks]: ||w_v,b - w_hat_v,b||
    # (ids [n], one x row [cols]) -> float32 [n]: those tokens' exact logits
    exact_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @property
    def groups(self) -> int:
        return int(self.packed.shape[0])

    @classmethod
    def of_rows(cls, rows: Callable[[int, int], torch.Tensor], vocab: int, cols: int,
                exact_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                key: bytes | None = None) -> HeadBound | None:
        """The copy of a head whose float32 rows r0..r1 `rows(r0, r1)` gives (None where
        cols is not a multiple of 32, there is no kernel here, or a row is not finite:
        the full path reports its NaN logits). `key` (head_cache.head_key of the head):
        the copy is mapped from the cache where it was stored, else built and stored."""
        if cols % BLOCK or not available():
            return None
        nb, groups = cols // BLOCK, -(-vocab // GROUP)
        if key is not None:
            cached = head_cache.load(key, vocab, cols, groups)
            if cached is not None:
                t, exact = cached
                return cls(t["packed"], t["scales"], vocab, cols, t["wnorm"],
                           None if exact else t["dnorm"], t["wblock"],
                           None if exact else t["dblock"], exact_logits)
        packed = torch.full((groups, nb, GROUP, BLOCK), -128, dtype=torch.int8)  # 0 + 128
        scales = torch.zeros((groups, nb, GROUP), dtype=torch.float16)
        wnorm = torch.empty(vocab, dtype=torch.float32)
        dnorm = torch.empty(vocab, dtype=torch.float32)
        wblock = torch.empty((vocab, nb), dtype=torch.float32)
        dblock = torch.empty((vocab, nb), dtype=torch.float32)
        for r0 in range(0, vocab, _ROWS):
            w = rows(r0, min(vocab, r0 + _ROWS))
            n = w.shape[0]
            q, d, approx = quantize_blocks(w, half_scales=True)
            g0, g1 = r0 // GROUP, -(-(r0 + n) // GROUP)
            pad = (g1 - g0) * GROUP - n
            if pad:
                q = torch.cat([q, q.new_zeros((pad, cols))])
                d = torch.cat([d, d.new_zeros((pad, nb))])
            packed[g0:g1] = pack_rows(q)
            scales[g0:g1] = d.view(-1, GROUP, nb).permute(0, 2, 1)
            diff = (w - approx).view(n, nb, BLOCK)
            torch.linalg.vector_norm(approx.view(n, nb, BLOCK), dim=2, out=wblock[r0:r0 + n])
            torch.linalg.vector_norm(diff, dim=2, out=dblock[r0:r0 + n])
            torch.linalg.vector_norm(approx, dim=1, out=wnorm[r0:r0 + n])
            torch.linalg.vector_norm(diff.view(n, cols), dim=1, out=dnorm[r0:r0 + n])
        if not (bool(torch.isfinite(wnorm).all()) and bool(torch.isfinite(dnorm).all())):
            return None
        exact = not bool(dnorm.any())  # a Q8_0 head's own values: no weight error
        if key is not None:
            head_cache.store(key, vocab, cols, {
                "packed": packed, "scales": scales, "wnorm": wnorm, "wblock": wblock,
                "dnorm": None if exact else dnorm, "dblock": None if exact else dblock})
        return cls(packed, scales, vocab, cols, wnorm, None if exact else dnorm, wblock,
                   None if exact else dblock, exact_logits)

    @classmethod
    def of_quantized(cls, weight: quant_linear.QuantizedWeight) -> HeadBound | None:
        """The copy of a quantized head: its dequantized rows, rounded again to 8 bits per
        32 values (a Q8_0 head's values are kept as they are); the exact logits are the
        head's own product on the candidates' blocks (quant_linear.matmul: the bytes the
        full logits hold for those tokens, whatever the batch)."""

        def rows(r0: int, r1: int) -> torch.Tensor:
            return quant_linear.dequantize(weight.data[r0:r1], weight.qtype, weight.cols)

        def exact_logits(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return quant_linear.matmul(x.view(1, -1), weight.data.index_select(0, ids),
                                       weight.qtype, weight.cols)[0]

        return cls.of_rows(rows, weight.rows, weight.cols, exact_logits,
                           head_cache.head_key(weight.data, f"ggml{weight.qtype}x{weight.cols}"))

    @classmethod
    def of_float(cls, weight: torch.Tensor) -> HeadBound | None:
        """The copy of a float32 head [vocab, cols] on the CPU. The exact logits are the
        rows gathered from `weight` (which must stay as it is) times x by one order of
        arithmetic for any number of candidates (quant_linear.matmul on F32 rows)."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            return None
        weight = weight.detach()

        def exact_logits(ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            rows = weight.index_select(0, ids).view(torch.uint8)
            return quant_linear.matmul(x.view(1, -1), rows, 0, weight.shape[1])[0]

        return cls.of_rows(lambda r0, r1: weight[r0:r1], weight.shape[0], weight.shape[1],
                           exact_logits, head_cache.head_key(weight, f"f32x{weight.shape[1]}"))

    def approx(self, x: torch.Tensor) -> torch.Tensor:
        """[N, groups * 8] float32: the pre-pass logits (no multiplier or cap) of x's rows,
        as the kernel gets them from quantize_blocks(x); columns past the vocabulary are
        padding."""
        q, d, _ = quantize_blocks(x)
        return self._approx(q, d)

    def _approx(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        n, width = q.shape[0], self.groups * GROUP
        out = torch.empty((n, width), dtype=torch.float32)
        if _matmul()(self.packed.data_ptr(), self.scales.data_ptr(), self.groups, self.cols,
                     q.data_ptr(), d.data_ptr(), n, out.data_ptr(), width) != 0:
            raise MemoryError("the LM head's pre-pass could not allocate its buffers")
        return out

    def error_terms(self, x: torch.Tensor, approx_x: torch.Tensor | None = None
                    ) -> ErrorTerms:
        """Row r's pre-pass logit of token v is within
            min(a[r] wnorm[v] + b[r] dnorm[v],
                sum_b eb[r, b] wblock[v, b] + xb[r, b] dblock[v, b]
                + slack[r] (wnorm[v] + dnorm[v]))
        of its exact logit (the dnorm and dblock terms only where they exist)."""
        if approx_x is None:
            approx_x = quantize_blocks(x)[2]
        n, nb = x.shape[0], self.cols // BLOCK
        e = x - approx_x
        xnorm = torch.linalg.vector_norm(x, dim=1)
        enorm = torch.linalg.vector_norm(e, dim=1)
        slack = _ROUNDING * self.cols * (xnorm + enorm)
        return ErrorTerms(
            (enorm + slack).contiguous(), (xnorm + slack).contiguous(),
            torch.linalg.vector_norm(e.view(n, nb, BLOCK), dim=2).contiguous(),
            torch.linalg.vector_norm(x.view(n, nb, BLOCK), dim=2).contiguous(),
            slack.contiguous())

    def candidates(self, x: torch.Tensor, approx: torch.Tensor, k: int = 1,
                   terms: ErrorTerms | None = None) -> list[torch.Tensor]:
        """Each row's tokens that can be among its k largest logits (k = 1: its argmax),
        ascending (int64): those whose upper end reaches the k-th largest lower end."""
        if not 1 <= k <= MAX_K:
            raise ValueError(f"k must be in [1, {MAX_K}], not {k}")
        n = x.shape[0]
        t = terms if terms is not None else self.error_terms(x)
        fn = _select()
        cap = max(_CAP, k)
        dn, db = self.dnorm, self.dblock
        while True:
            ids = torch.empty((n, cap), dtype=torch.int64)
            counts = torch.empty(n, dtype=torch.int64)
            rc = fn(approx.data_ptr(), n, self.vocab, approx.stride(0), t.a.data_ptr(),
                    t.b.data_ptr(), self.wnorm.data_ptr(),
                    None if dn is None else dn.data_ptr(), self.cols // BLOCK,
                    t.eb.data_ptr(), t.xb.data_ptr(), self.wblock.data_ptr(),
                    None if db is None else db.data_ptr(), t.slack.data_ptr(),
                    k, cap, ids.data_ptr(), counts.data_ptr())
            if rc != 0:
                raise MemoryError("the LM head's pre-pass could not allocate its buffers")
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
        x = x.contiguous()
        ids = torch.full((x.shape[0], k), -1, dtype=torch.int64)
        values = torch.full((x.shape[0], k), float("-inf"), dtype=torch.float32)
        for r0 in range(0, x.shape[0], MAX_ROWS):
            xs = x[r0:r0 + MAX_ROWS]
            prepared = prepare(xs)
            if prepared is None:
                return None  # a value of x that is not finite
            q, d, terms = prepared
            found = self.candidates(xs, self._approx(q, d), k, terms)
            if any(len(cand) == 0 for cand in found):
                return None  # a bound that is not finite: the full path
            self._rescore(xs, found, k, ids[r0:r0 + MAX_ROWS], values[r0:r0 + MAX_ROWS])
        return ids, values

    def _rescore(self, x: torch.Tensor, found: list[torch.Tensor], k: int,
                 ids: torch.Tensor, values: torch.Tensor) -> None:
        """The candidates' exact logits; each row's k best into ids, values."""
        if k == 1 and len(found) == 1:  # a batch-1 step: one row, its argmax
            [cand] = found
            logits = self.exact_logits(cand, x[0])
            at = int(torch.argmax(logits))  # the first of equal values: the lowest id
            ids[0, 0], values[0, 0] = cand[at], logits[at]
            return
        counts = torch.tensor([len(c) for c in found])
        cand = torch.cat(found)
        # Each row's candidates alone: a logit's bytes do not depend on the rows beside it.
        exact = torch.cat([self.exact_logits(c, x[r]) for r, c in enumerate(found)])
        if k == 1:
            owner = torch.repeat_interleave(torch.arange(len(found)), counts)
            best = torch.full((len(found),), float("-inf")).scatter_reduce(
                0, owner, exact, "amax")
            where = torch.where(exact == best[owner], torch.arange(len(cand)), len(cand))
            first = torch.full((len(found),), len(cand)).scatter_reduce(0, owner, where,
                                                                        "amin")
            ids[:, 0], values[:, 0] = cand[first], exact[first]
            return
        start = 0
        for r, n in enumerate(counts.tolist()):
            row = exact[start:start + n]
            order = torch.sort(row, descending=True, stable=True).indices[:k]
            ids[r, :len(order)] = cand[start:start + n][order]
            values[r, :len(order)] = row[order]
            start += n

    def head_candidates(self, x: torch.Tensor, k: int,
                        scale: Callable[[torch.Tensor], torch.Tensor]) -> HeadCandidates | None:
        """top() as head candidates, the values passed through `scale` (the head's
        multiplier and soft cap)."""
        found = self.top(x, k)
        if found is None:
            return None
        ids, values = found
        return HeadCandidates(scale(values), ids, torch.zeros(ids.shape[0], dtype=torch.bool))


def quantize_blocks(t: torch.Tensor, half_scales: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 [n, cols] (cols a multiple of 32) -> (int8 values [n, cols], float32 scales
    [n, cols / 32], the float32 values they hold [n, cols]): per 32 values d = max|t| / 127
    and round(t * (1 / d)) to nearest even (0 for a block of zeros). The head's copy and
    x are rounded alike; the copy's scales are rounded to IEEE halves first (`half_scales`,
    as the kernel reads them: a value then rounds to at most 127.06 d, still 127). A Q8_0
    head's scales are halves already, so its values stay as they are."""
    n, cols = t.shape
    blocks = t.reshape(n, cols // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=2) / 127.0
    if half_scales:
        d = d.to(torch.float16).to(torch.float32)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[:, :, None]).clamp_(-127, 127)
    return (q.to(torch.int8).view(n, cols).contiguous(), d.contiguous(),
            (q * d[:, :, None]).view(n, cols))


def prepare(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ErrorTerms] | None:
    """quantize_blocks(x)'s values and scales and error_terms(x) in one C call (float32 x
    [n, cols], contiguous); None where a value of x is not finite."""
    n, cols = x.shape
    nb = cols // BLOCK
    q = torch.empty((n, cols), dtype=torch.int8)
    d, eb, xb = (torch.empty((n, nb), dtype=torch.float32) for _ in range(3))
    a, b, slack = (torch.empty(n, dtype=torch.float32) for _ in range(3))
    if _function("hkv_head_prepare", _PREPARE_ARGS, ctypes.c_int)(
            x.data_ptr(), n, cols, _ROUNDING, q.data_ptr(), d.data_ptr(), a.data_ptr(),
            b.data_ptr(), eb.data_ptr(), xb.data_ptr(), slack.data_ptr()):
        return None
    return q, d, ErrorTerms(a, b, eb, xb, slack)


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it (quantize_blocks' values)."""
    return quantize_blocks(x)[2]


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int8 [8 g, cols] -> [g, cols / 32, 8, 32]: per group of 8 rows and 32-value block,
    8 chunks of the 8 rows' values 4j..4j+3, each as the byte w + 128 (the kernel's
    layout: its unsigned operand)."""
    rows, cols = q.shape
    return (q.view(rows // GROUP, GROUP, cols // BLOCK, BLOCK // 4, 4)
            .permute(0, 2, 3, 1, 4).reshape(rows // GROUP, cols // BLOCK, GROUP, BLOCK)
            ^ -128)


def available() -> bool:
    """Whether the pre-pass kernel is compiled here with its AVX2 code (the portable code
    checks it in tests; it is too slow to gain anything)."""
    try:
        return bool(_function("hkv_head_i8_portable", [ctypes.c_int], ctypes.c_int)(0))
    except native.NativeBuildError:
        return False


def force_portable(on: bool) -> None:
    """Tests: the kernel's portable code on an AVX2 machine."""
    _function("hkv_head_i8_portable", [ctypes.c_int], ctypes.c_int)(int(on))


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# approx, n, vocab, ld, a, b, wnorm, dnorm, nb, eb, xb, wblock, dblock, slack, k, cap,
# ids, counts
_SELECT_ARGS = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR,
                _PTR, _I64, _I64, _PTR, _PTR]
# packed, scales, groups, cols, xq, xd, m, y, ldy
_MATMUL_ARGS = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64]
# x, n, cols, rounding, q, d, a, b, eb, xb, slack
_PREPARE_ARGS = [_PTR, _I64, _I64, ctypes.c_float, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR]


def _function(symbol: str, argtypes: list[Any], restype: Any = None
              ) -> Callable[..., int]:
    fn = native.function("head_bound", symbol, argtypes, restype)
    if fn is None:
        raise native.NativeBuildError("worker/native/head_bound.c does not build here")
    return fn  # type: ignore[no-any-return]


def _select() -> Callable[..., int]:
    return _function("hkv_head_bound_select", _SELECT_ARGS, ctypes.c_int)


def _matmul() -> Callable[..., int]:
    return _function("hkv_head_i8_matmul", _MATMUL_ARGS, ctypes.c_int)
