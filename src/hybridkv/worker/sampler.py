"""Greedy, temperature, top-k and top-p sampling with per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.sched.sampling import SamplingParams


@dataclass
class SamplerOutput:
    tokens: dict[str, int]  # per request that sampled
    logprobs: dict[str, dict[int, float]]  # per request that asked for them
    errors: dict[str, str]  # per request whose sampling failed: what went wrong


class Sampler:
    def __init__(self) -> None:
        # A seeded request draws from its own generator, so its tokens do not depend on
        # what else is in the batch.
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> SamplerOutput:
        """logits [R, V] -> one token per row, plus top logprobs where asked. A row that
        fails is reported in `errors` and gets no token: one request's failure must not take
        its batch-mates down."""
        logits = logits.float()
        out = SamplerOutput({}, {}, {})
        if all(p.greedy for p in params):  # the common case: one argmax for the batch
            out.tokens.update(zip(request_ids, torch.argmax(logits, dim=-1).tolist(),
                                  strict=True))
        for row, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            try:
                if rid not in out.tokens:
                    out.tokens[rid] = self._sample_row(logits[row], rid, p)
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

    def _sample_row(self, logits: torch.Tensor, rid: str, p: SamplingParams) -> int:
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p (the top token always stays).
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        generator = None
        if p.seed is not None:
            generator = self.generators.get(rid)
            if generator is None:
                generator = torch.Generator(device=logits.device).manual_seed(p.seed)
                self.generators[rid] = generator
        return int(torch.multinomial(probs, 1, generator=generator))
