"""The scheduler's proposers behind `speculative_config["method"]`: one small module each,
registered here by name. Worker methods (a draft model) have none here: the worker makes
their drafts (worker/spec/draft_model.py) in the slots the scheduler reserves."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from hybridkv.sched.spec.config import SCHEDULER_METHODS, SpeculativeConfig


class Proposer(Protocol):
    """Guesses the tokens that follow a request's tokens. Must not mutate anything it is
    given; may return fewer tokens than asked (none: no guess this step)."""

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]: ...


def _ngram(config: SpeculativeConfig) -> Proposer:
    from hybridkv.sched.spec.ngram import NgramProposer

    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


_REGISTRY: dict[str, Callable[[SpeculativeConfig], Proposer]] = {"ngram": _ngram}
assert tuple(_REGISTRY) == SCHEDULER_METHODS


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The scheduler's proposer of `config`'s method; None for a worker method."""
    if config.drafts_in_worker:
        return None
    make = _REGISTRY.get(config.method)
    if make is None:  # SpeculativeConfig refuses unknown methods first
        raise ValueError(f"unknown speculative method {config.method!r}; accepted: "
                         f"{', '.join(_REGISTRY)}")
    return make(config)
