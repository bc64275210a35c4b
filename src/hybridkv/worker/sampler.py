"""Greedy, temperature, top-k and top-p sampling with per-request seeds."""

from __future__ import annotations

import torch

from hybridkv.sched.sampling import SamplingParams


class Sampler:
    def __init__(self) -> None:
        # A seeded request draws from its own generator, so its tokens do not depend on
        # what else is in the batch.
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits [R, V] -> one token per row, plus top logprobs where asked."""
        logits = logits.float()
        if all(p.greedy for p in params):  # the common case: one argmax for the batch
            tokens = torch.argmax(logits, dim=-1).tolist()
        else:
            tokens = [self._sample_row(logits[row], rid, p)
                      for row, (rid, p) in enumerate(zip(request_ids, params, strict=True))]
        logprobs: list[dict[int, float] | None] = []
        for row, p in enumerate(params):
            if p.logprobs is None:
                logprobs.append(None)
                continue
            lp = torch.log_softmax(logits[row], dim=-1)
            top = torch.topk(lp, min(p.logprobs, lp.shape[-1]))
            entry = {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)}
            entry[tokens[row]] = float(lp[tokens[row]])
            logprobs.append(entry)
        return tokens, logprobs

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
