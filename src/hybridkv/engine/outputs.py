"""What the engine returns per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None
    new_token_ids: list[int] = field(default_factory=list)  # this step's (streaming)
    new_text: str = ""
    error: str | None = None  # what went wrong, when finish_reason is "error"
    # What stopped a "stop" request: the stop string, or the token id (EOS, a stop token).
    stop_reason: int | str | None = None
    # Prompt tokens reused instead of computed (from any place), and per place:
    # {"device": ..., "cpu": ..., "disk": ..., "remote": ...}.
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    index: int = 0  # which of the request's n samples this is
    # Speculative decoding: draft tokens scored for this request so far, and how many of
    # them the target model kept (0 and 0 without speculation).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
