"""A request as the engine tracks it: prompt, outputs, sampling, status."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hybridkv.kv.hashing import BlockHasher
from hybridkv.kv.request import KVRequest
from hybridkv.sched.sampling import SamplingParams

if TYPE_CHECKING:  # the grammar library is imported only where structured output is used
    from hybridkv.sched.structured.manager import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # its prefix is loading from an offload tier
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed inside a step; the other requests went on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request(KVRequest):
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, *, hash_block_size: int,
                 eos_token_ids: Sequence[int] = (), arrival_index: int = 0,
                 priority: int = 0, cache_salt: str | None = None,
                 block_hasher: BlockHasher | None = None,
                 part_points: Sequence[int] = ()) -> None:
        super().__init__(request_id, prompt_token_ids, hash_block_size=hash_block_size,
                         cache_salt=cache_salt, block_hasher=block_hasher)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_index = arrival_index
        self.priority = priority
        # Prompt positions where later requests are expected to part from this one (a
        # chat's last message starts there): state layers save a checkpoint at each.
        self.part_points = tuple(part_points)
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_tokens_at_preemption = 0  # computed tokens when last preempted
        self.output_logprobs: list[dict[int, float]] = []
        self.stop_reason: int | str | None = None
        # Prompt tokens reused at its first admission, and where they came from.
        self.num_cached_tokens: int | None = None
        self.cached_tokens_by_tier: dict[str, int] = {}
        # Structured output: its grammar (set by the engine); the request is not admitted
        # until the grammar has compiled.
        self.grammar: RequestGrammar | None = None
        # Speculative decoding: draft tokens scheduled this step (never in `token_ids`:
        # they are not the request's until verified), and totals over its life.
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafts = 0  # steps that scored drafts
        # Steps to skip drafting, and the current length of that pause (scheduler.py:
        # DRAFT_BACKOFF_MAX).
        self.draft_pause = 0
        self.draft_backoff = 0
        # The most drafts it takes next: one at first, one past the drafts kept after a
        # rejection, twice as many after a step that kept them all (scheduler.py:
        # draft_limit).
        self.draft_limit = 1
        # Tokens appended by the last step (1, or more with accepted drafts).
        self.num_new_tokens = 0

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (a step's tokens past a stop are dropped);
        block hashes of dropped tokens go with them."""
        if num_tokens < self.num_prompt_tokens:
            raise ValueError(f"cannot truncate request {self.request_id} into its prompt")
        del self.token_ids[num_tokens:]
        del self.block_hashes[num_tokens // self.hash_block_size:]

    @property
    def waiting_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.ready

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens
