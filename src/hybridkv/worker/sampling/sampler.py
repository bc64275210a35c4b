"""Sampling: the grammar mask of structured-output rows, logit bias and penalties, then
greedy or temperature with top-k, min-p and top-p, with per-request seeds. Top logprobs are
those of the model's own logits (before any of this), as vLLM returns them by default."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.structured.manager import GrammarBitmask, StepGrammars


@dataclass
class SamplerOutput:
    tokens: dict[str, int]  # per request that sampled
    logprobs: dict[str, dict[int, float]]  # per request that asked for them
    errors: dict[str, str]  # per request whose sampling failed: what went wrong


# rid -> (every token of the request so far, how many of them are the prompt's)
History = Callable[[str], tuple[Sequence[int], int]]


class Sampler:
    def __init__(self) -> None:
        # A seeded request draws from its own generator, so its tokens do not depend on
        # what else is in the batch.
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams], history: History | None = None,
               grammars: StepGrammars | None = None) -> SamplerOutput:
        """logits [R, V] -> one token per row, plus top logprobs where asked. `history`
        gives a request's tokens (needed by penalties only); `grammars` the structured-
        output rows' grammars (a row's forbidden tokens get -inf before anything else). A
        row that fails is reported in `errors` and gets no token: one request's failure
        must not take its batch-mates down."""
        logits = logits.float()
        out = SamplerOutput({}, {}, {})
        constrained = [rid in grammars for rid in request_ids] if grammars is not None \
            else [False] * len(request_ids)
        if any(p.plain_argmax for p in params):
            # Rows with nothing to apply share one argmax (commonly: all). A constrained
            # greedy row keeps it when its grammar allows it: the masked argmax is the same
            # token, so no mask is computed for it.
            for row, (rid, p, token) in enumerate(zip(
                    request_ids, params, torch.argmax(logits, dim=-1).tolist(), strict=True)):
                if p.plain_argmax and (not constrained[row]
                                       or (grammars is not None
                                           and grammars.allows(rid, token))):
                    out.tokens[rid] = token
        # The other constrained rows get a masked copy (logprobs stay those of the model's
        # logits); the mask goes first: a bias cannot bring back a masked token.
        masked_at: dict[int, int] = {}
        masked = logits
        need = [rid for row, rid in enumerate(request_ids)
                if constrained[row] and rid not in out.tokens]
        if need:
            assert grammars is not None
            masked_at, masked = masked_rows(grammars.bitmask(need), request_ids, logits)
        greedy = [row for row in masked_at if params[row].plain_argmax]
        if greedy:  # constrained greedy rows: one argmax over their masked copies too
            index = torch.tensor([masked_at[row] for row in greedy], device=logits.device)
            for row, token in zip(greedy, masked.index_select(0, index).argmax(-1).tolist(),
                                  strict=True):
                out.tokens[request_ids[row]] = token
        for row, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            try:
                if rid not in out.tokens:
                    row_logits = masked[masked_at[row]] if row in masked_at else logits[row]
                    row_logits = self._adjust(row_logits, rid, p, history)
                    out.tokens[rid] = self._sample_row(row_logits, rid, p)
                if p.logprobs is not None:
                    out.logprobs[rid] = self._logprobs(logits[row], out.tokens[rid],
                                                       p.logprobs)
            except Exception as e:  # reported per request below, never swallowed
                out.tokens.pop(rid, None)
                out.errors[rid] = f"sampling failed: {type(e).__name__}: {e}"
        return out

    @staticmethod
    def _logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
        lp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(lp, min(k, lp.shape[-1]))
        entry = {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)}
        entry[token] = float(lp[token])
        return entry

    @staticmethod
    def _adjust(logits: torch.Tensor, rid: str, p: SamplingParams,
                history: History | None) -> torch.Tensor:
        """Logit bias, then the penalties on tokens seen so far (a new tensor)."""
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                device=logits.device)
            logits = logits.index_add(0, ids, bias)
        if not p.penalized:
            return logits
        if history is None:
            raise RuntimeError("penalties need the request's tokens, and none were given")
        tokens, num_prompt = history(rid)
        seen = torch.tensor(list(tokens), dtype=torch.int64, device=logits.device)
        vocab = logits.shape[-1]
        counts = torch.bincount(seen[num_prompt:], minlength=vocab)[:vocab].to(logits.dtype)
        if p.repetition_penalty != 1.0:
            # Prompt tokens count here too (as in vLLM and transformers); a positive logit
            # is divided and a negative one multiplied, so both become less likely.
            in_prompt = torch.bincount(seen[:num_prompt], minlength=vocab)[:vocab] > 0
            hit = in_prompt | (counts > 0)
            penalized = torch.where(logits > 0, logits / p.repetition_penalty,
                                    logits * p.repetition_penalty)
            logits = torch.where(hit, penalized, logits)
        if p.frequency_penalty:
            logits = logits - p.frequency_penalty * counts
        if p.presence_penalty:
            logits = logits - p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _sample_row(self, logits: torch.Tensor, rid: str, p: SamplingParams) -> int:
        if p.greedy:
            return int(torch.argmax(logits))
        probs = self.probs(logits, p)
        return int(torch.multinomial(probs, 1,
                                     generator=self.generator(rid, p, logits.device)))

    def target_rows(self, logits: torch.Tensor, rid: str, p: SamplingParams
                    ) -> torch.Tensor:
        """logits [n, V] of one request's consecutive positions -> what its tokens are
        drawn from at each: the logits with its bias (greedy: argmax them), else the
        probabilities after temperature, top-k, min-p and top-p. Penalties depend on the
        tokens before each position and are not applied here (requests with penalties
        draft nothing)."""
        if p.penalized:
            raise ValueError("target_rows takes no penalized request")
        rows = [self._adjust(row, rid, p, None) for row in logits.float()]
        if p.greedy:
            return torch.stack(rows)
        return torch.stack([self.probs(row, p) for row in rows])

    def generator(self, rid: str, p: SamplingParams, device: torch.device
                  ) -> torch.Generator | None:
        """A seeded request's own generator (None: the global one)."""
        if p.seed is None:
            return None
        generator = self.generators.get(rid)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(p.seed)
            self.generators[rid] = generator
        return generator

    @staticmethod
    def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """One row's sampling distribution: temperature, top-k, min-p, top-p."""
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            # Relative to the most likely token: a flat distribution keeps many tokens, a
            # peaked one few (the top token always stays).
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()  # top-p below reads cumulative mass
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p (the top token always stays).
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
            drop[0] = False  # a top_p below float32's smallest (1e-45) would drop it too
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return probs



def masked_rows(bitmask: GrammarBitmask, request_ids: list[str], logits: torch.Tensor
                ) -> tuple[dict[int, int], torch.Tensor]:
    """(row -> its index in the copy, a copy of the constrained rows with every token the
    mask forbids at -inf). Ids past the mask (logits padded wider than the vocabulary) are
    never allowed."""
    row_of = {rid: i for i, rid in enumerate(request_ids)}
    rows = [row_of[rid] for rid in bitmask.request_ids]
    masked = logits[torch.tensor(rows, device=logits.device)]  # a copy
    words = bitmask.words
    kernel = _mask_kernel() if masked.device.type == "cpu" else None
    if kernel is not None:
        words = np.ascontiguousarray(words)
        kernel(masked.data_ptr(), masked.stride(0), words.ctypes.data, words.shape[1],
               words.shape[1], masked.shape[0], masked.shape[1])
    else:
        # Bit t of word t // 32, on the logits' device.
        vocab = masked.shape[1]
        w = torch.from_numpy(words.astype(np.int32)).to(masked.device)
        shifts = torch.arange(32, dtype=torch.int32, device=masked.device)
        allowed = ((w.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()[:, :vocab]
        if allowed.shape[1] < vocab:
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        masked.masked_fill_(~allowed, float("-inf"))
    return {row: i for i, row in enumerate(rows)}, masked


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# logits, their row stride, words, their row stride, words a row, rows, vocabulary
_MASK_ARGTYPES = [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64]


def _mask_kernel() -> Callable[..., None] | None:
    """The C masking kernel (worker/native/token_mask.c), None where it cannot be built."""
    from hybridkv.worker import native

    fn: Callable[..., None] | None = native.function("token_mask", "hkv_mask_logits",
                                                     _MASK_ARGTYPES)
    return fn
