"""The proposers behind `speculative_config["method"]`: one small module each, registered
here by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from hybridkv.sched.spec.config import METHODS, SpeculativeConfig


class Proposer(Protocol):
    """Guesses the tokens that follow a request's tokens. Must not mutate anything it is
    given; may return fewer tokens than asked (none: no guess this step)."""

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]: ...


def _ngram(config: SpeculativeConfig) -> Proposer:
    from hybridkv.sched.spec.ngram import NgramProposer

    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


_REGISTRY: dict[str, Callable[[SpeculativeConfig], Proposer]] = {"ngram": _ngram}
assert tuple(_REGISTRY) == METHODS


def make_proposer(config: SpeculativeConfig) -> Proposer:
    make = _REGISTRY.get(config.method)
    if make is None:  # SpeculativeConfig refuses unknown methods first
        raise ValueError(f"unknown speculative method {config.method!r}; accepted: "
                         f"{', '.join(_REGISTRY)}")
    return make(config)
