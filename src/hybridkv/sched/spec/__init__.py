"""Speculative decoding, the scheduler's half: the user's `speculative_config`, and the
proposers that guess a request's next tokens (drafts) from what it knows.

    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    proposer = make_proposer(config)
    drafts = proposer.propose(request.token_ids, 4)     # [] when it has no guess

Drafts are scheduled as extra tokens of their request; the target model scores them in one
pass and the rejection sampler (worker/sampling/rejection.py) keeps the longest valid prefix.
A proposer knows nothing of the rejection sampler, and the sampler nothing of proposers.
"""

from __future__ import annotations

from hybridkv.sched.spec.config import METHODS, SpeculativeConfig
from hybridkv.sched.spec.proposer import Proposer, make_proposer

__all__ = ["METHODS", "Proposer", "SpeculativeConfig", "make_proposer"]
