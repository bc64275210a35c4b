"""Continuous batching with one token budget per step, chunked prefill and preemption.

No prefill or decode phases: every step hands out `max_num_batched_tokens` to running
requests first (a decode takes 1, an unfinished prompt takes up to the rest), then admits
waiting requests, reusing prefix-cache hits. When the KV cache cannot grow a running request,
the latest admitted request is preempted (its blocks freed, its tokens recomputed later).

The scheduler never touches tensors: it sends the worker block ids per group and a diff.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from hybridkv.connector.base import ConnectorMeta
from hybridkv.connector.scheduler import OffloadConnectorScheduler
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.shared_prompts import SharedPrompts
from hybridkv.sched.request import Request, RequestStatus
from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.spec import Proposer, SpeculativeConfig, make_proposer
from hybridkv.sched.spec.config import MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from hybridkv.sched.structured.manager import StepGrammars


# A request whose drafts were all rejected drafts again only after this many steps, doubled
# at each further miss up to the cap (a hit resets it): scoring drafts that miss costs
# compute, and text that stopped repeating its context tends to stay so for a while.
DRAFT_BACKOFF_MAX = 16

# At large batches the engine speculates less: a step's drafts are shared out so that each
# running request gets at most DRAFT_TOKENS_PER_STEP // (running requests) of them, and at
# least one. A decode step of a few requests costs about as much as one of a few more tokens
# (it reads every weight once either way), so drafts come nearly free; with many requests
# the step's cost grows with its tokens and each rejected draft is paid for. E.g. K = 4:
# up to 8 running requests draft 4 each, 16 draft 2, 32 and more draft 1.
DRAFT_TOKENS_PER_STEP = 32

# The most state checkpoints one request saves for other requests' prompts that leave its
# own (each is a state block while it is written): prompts arriving together usually part
# at one point (the end of a shared system prompt).
SHARED_CHECKPOINTS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # "fcfs": arrival order. "priority": lower `priority` first (ties by arrival), and the
    # lowest-priority running request is the one preempted.
    policy: str = "fcfs"
    # Speculative decoding (None: off): decoding requests get drafts as extra tokens.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}; accepted: fcfs, "
                             f"priority")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class NewRequestData:
    """A request the worker has not seen (or must rebuild after preemption)."""

    request_id: str
    token_ids: list[int]  # every known token (prompt, plus outputs after a preemption)
    block_ids: list[list[int]]  # per group
    num_computed_tokens: int
    sampling_params: SamplingParams
    num_prompt_tokens: int  # of token_ids: the rest are outputs (penalties tell them apart)


@dataclass(frozen=True)
class CachedRequestData:
    """A request the worker already holds: only what changed."""

    request_id: str
    new_token_ids: list[int]  # tokens appended since the worker last saw it
    new_block_ids: list[list[int]]  # per group
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_request_ids: set[str] = field(default_factory=set)  # worker drops their state
    preempted_request_ids: set[str] = field(default_factory=set)
    # State checkpoints to write in this step, per request: (group, token position, block).
    state_checkpoints: dict[str, tuple[tuple[int, int, int], ...]] = field(
        default_factory=dict)
    # Per request with drafts this step: the draft tokens, scheduled after its known tokens
    # (counted in num_scheduled_tokens, never in the request's token ids).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Per request whose drafts the worker's draft model makes at the step's start: how many
    # (their slots are scheduled after its known tokens, as above; the worker returns them).
    num_draft_slots: dict[str, int] = field(default_factory=dict)
    # The KV connector's loads and stores of this step (None: no connector).
    kv_connector_meta: ConnectorMeta | None = None
    # The grammars of the structured-output requests that sample this step, which give
    # their token masks (set by the engine after `schedule`; None: no such request).
    grammars: StepGrammars | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: OffloadConnectorScheduler | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests waiting for their prefix to load from a tier (holding its blocks); they
        # rejoin `waiting` at the front when the loads are done.
        self.loading: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        # Tokens of each running request the worker has seen (to send only new ones).
        self._num_sent_tokens: dict[str, int] = {}
        self.num_preemptions = 0
        # Requests shown to need more KV cache than exists even with nothing else running;
        # the engine finishes them with an error (`take_never_fitting`).
        self._never_fitting: list[Request] = []
        # Per request preempted while running alone: the tokens it was trying to hold.
        self._alone_target: dict[str, int] = {}
        # Prompt blocks by hash, so that a request prefilling a prefix that other requests'
        # prompts share saves a state checkpoint where they part: the running requests
        # still prefilling, and the waiting ones (None: no state group saves branch
        # points).
        on = kv_cache_manager.saves_branch_points
        self._prefilling = SharedPrompts() if on else None
        self._waiting_prompts = SharedPrompts() if on else None
        # Per waiting request: (prefilling version, shared prefix tokens, the prefilling
        # requests whose prompts have it), as last computed.
        self._matches: dict[str, tuple[int, int, list[str]]] = {}
        self._asked: dict[str, set[int]] = {}  # per running request: checkpoints asked for
        spec = config.speculative
        # None with a worker method (a draft model): the scheduler reserves slots only.
        self.proposer: Proposer | None = make_proposer(spec) if spec is not None else None
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self._num_drafting = 0  # requests with drafts in the step being scheduled
        self._max_drafts = 0  # drafts per request in that step (DRAFT_TOKENS_PER_STEP)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self._waiting_prompts is not None:
            self._waiting_prompts.add(request)
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, *, front: bool) -> None:
        if self.config.policy == "priority":
            # Keep `waiting` sorted by (priority, arrival); a preempted request goes back to
            # its place, which is first among its priority.
            key = (request.priority, request.arrival_index)
            index = next((i for i, r in enumerate(self.waiting)
                          if (r.priority, r.arrival_index) > key), len(self.waiting))
            self.waiting.insert(index, request)
        elif front:
            self.waiting.appendleft(request)  # FCFS: a preempted request is next again
        else:
            self.waiting.append(request)

    def _victim(self) -> tuple[int, Request]:
        """Remove and return (position, request) of the running request to preempt: the
        latest admitted (FCFS), or the lowest priority, latest arrival first (priority)."""
        position = len(self.running) - 1
        if self.config.policy == "priority":
            position = max(range(len(self.running)), key=lambda i: (
                self.running[i].priority, self.running[i].arrival_index))
        return position, self.running.pop(position)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.config.max_num_batched_tokens
        self._num_drafting = 0
        self._max_drafts = drafts_per_request(self.num_speculative_tokens, len(self.running))
        self.kv.new_step_starts()
        connector = self.connector
        if connector is not None:
            for rid in connector.take_finished_loads():
                loaded = self.loading.pop(rid, None)
                if loaded is not None:
                    loaded.status = RequestStatus.WAITING
                    self._enqueue(loaded, front=True)
        if self._prefilling:  # requests are prefilling
            self._ask_shared_checkpoints()

        # Running requests first, in admission order.
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_drafts = self._num_drafts(req, num_new, budget) if self._max_drafts else 0
            drafts = self._propose(req, num_drafts)
            num_drafts = len(drafts) if self.proposer is not None else num_drafts
            self._num_drafting += bool(num_drafts)
            while (new := self.kv.allocate_slots(req, num_new + num_drafts)) is None:
                if num_drafts:
                    drafts, num_drafts = [], 0  # drafts never cost a preemption
                    continue
                if connector is not None and connector.release_done_loads():
                    continue  # loaded prefixes of waiting requests held memory
                position, victim = self._victim()
                alone = victim is req and not self.running and not self.loading
                budget += self._preempt(victim, out)  # gives back what it was scheduled
                if position < index:
                    index -= 1
                if alone:
                    self._preempted_alone(req, req.num_tokens_at_preemption + num_new)
                if victim is req:
                    break
            if new is None:
                continue  # req was preempted; the next request moved into its place
            new_blocks = new.block_ids()
            if new.checkpoints:
                out.state_checkpoints[req.request_id] = new.checkpoints
            budget -= num_new
            if drafts:
                req.spec_token_ids = drafts
                out.scheduled_spec_decode_tokens[req.request_id] = drafts
            elif num_drafts:
                out.num_draft_slots[req.request_id] = num_drafts
            budget -= num_drafts
            if (self._prefilling is not None and req.request_id in self._prefilling
                    and req.num_computed_tokens + num_new >= req.num_prompt_tokens):
                self._prefilling.remove(req.request_id)  # its prompt is computed this step
            sent = self._num_sent_tokens[req.request_id]
            out.cached_requests.append(CachedRequestData(
                req.request_id, req.token_ids[sent:], new_blocks, req.num_computed_tokens))
            self._num_sent_tokens[req.request_id] = req.num_tokens
            out.num_scheduled_tokens[req.request_id] = num_new + num_drafts
            index += 1

        # Then waiting requests, unless this step had to preempt (memory is short).
        while (self.waiting and budget > 0 and not out.preempted_request_ids
               and len(self.running) < self.config.max_num_seqs):
            # A request whose grammar is still compiling keeps its place; those behind it
            # are admitted meanwhile.
            ready = next((r for r in self.waiting if not r.waiting_for_grammar), None)
            if ready is None:
                break
            req = ready
            hit = self.kv.get_computed_blocks(req)
            if connector is not None and connector.start_load(req, hit.num_computed_tokens):
                # A tier holds more of its prompt: it waits for the loads, the rest go on.
                self.waiting.remove(req)
                req.status = RequestStatus.WAITING_FOR_KV
                self.loading[req.request_id] = req
                continue
            num_new = req.num_tokens - hit.num_computed_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self._waiting_prompts is not None:
                self._checkpoint_where_waiting_leave(req, hit.num_computed_tokens)
            for position in req.part_points:  # where later prompts are expected to part
                if position > hit.num_computed_tokens:
                    self.kv.want_checkpoint(req, position)
            new = self.kv.allocate_slots(req, num_new, hit.num_computed_tokens, hit.blocks)
            if new is None and connector is not None:
                connector.request_not_admitted(req)
                if connector.release_done_loads():
                    # Other waiting requests' loaded prefixes held memory: try again.
                    new = self.kv.allocate_slots(req, num_new, hit.num_computed_tokens,
                                                 hit.blocks)
            if new is None:
                if not self.running and not out.preempted_request_ids and not self.loading:
                    # Nothing holds memory and still no room: it can never be admitted.
                    # (After a preemption in this step, memory is freed: retry next step.)
                    self._never_fit(req)
                    continue
                break  # head of line waits for memory
            if new.checkpoints:
                out.state_checkpoints[req.request_id] = new.checkpoints
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if self._prefilling is not None and self._waiting_prompts is not None:
                self._waiting_prompts.remove(req.request_id)
                self._matches.pop(req.request_id, None)
                if hit.num_computed_tokens + num_new < req.num_prompt_tokens:
                    self._prefilling.add(req)
            req.num_computed_tokens = hit.num_computed_tokens
            by_tier = (connector.request_admitted(req, hit.num_computed_tokens)
                       if connector is not None else {"device": hit.num_computed_tokens})
            if req.num_cached_tokens is None:  # the first admission's, as vLLM reports it
                req.num_cached_tokens = hit.num_computed_tokens
                req.cached_tokens_by_tier = by_tier
            self.running.append(req)
            budget -= num_new
            out.new_requests.append(NewRequestData(
                req.request_id, list(req.token_ids), self.kv.get_block_ids(req.request_id),
                req.num_computed_tokens, req.sampling_params, req.num_prompt_tokens))
            self._num_sent_tokens[req.request_id] = req.num_tokens
            out.num_scheduled_tokens[req.request_id] = num_new
        if connector is not None:
            out.kv_connector_meta = connector.build_meta()
        return out

    # ------------------------------------------------------------ drafts
    def _num_drafts(self, req: Request, num_new: int, budget: int) -> int:
        """How many drafts a decoding request whose known tokens all fit this step may have:
        within the step's share (DRAFT_TOKENS_PER_STEP), the budget, max_model_len and
        max_tokens (a draft past either could never be kept). Requests with penalties,
        logprobs or a grammar draft nothing (their tokens' distributions depend on the
        tokens before them in ways the verification does not replay)."""
        params = req.sampling_params
        if (req.num_computed_tokens < req.num_prompt_tokens
                or req.num_computed_tokens + num_new != req.num_tokens
                or params.penalized or params.logprobs is not None
                or req.grammar is not None):
            return 0
        if req.draft_pause > 0:
            req.draft_pause -= 1
            return 0
        limit = self.kv.max_drafting_requests  # state groups keep a state per drafter
        if limit is not None and self._num_drafting >= limit:
            return 0
        return max(0, min(req.draft_limit, self._max_drafts,
                          budget - num_new,
                          self.config.max_model_len - req.num_tokens - 1,
                          params.max_tokens - req.num_output_tokens - 1))

    def _propose(self, req: Request, num_drafts: int) -> list[int]:
        """The scheduler's proposer's drafts (none with a worker method: the worker makes
        them in the slots reserved)."""
        if num_drafts < 1 or self.proposer is None:
            return []
        return self.proposer.propose(req.token_ids, num_drafts)[:num_drafts]

    # ------------------------------------------------------------ shared prefills
    # A request is admitted only once the running ones have all their prompt tokens
    # scheduled (they take the budget first), so a prefix it shares with them is cached
    # by then, in attention groups. A state group hits only at a checkpoint, though: the
    # prefilling request saves one where a waiting request's prompt leaves its own (a
    # branch point of a prefix still being computed), which is how requests arriving
    # together with one long prefix (a system prompt, N users) compute it once.
    def _ask_shared_checkpoints(self) -> None:
        """Before this step's allocations: a running request still prefilling a prefix that
        a waiting request shares saves a state checkpoint where the waiting one leaves it.
        Only the requests that could be admitted soon are looked at, and each again only
        when the prefilling requests change, so a long queue costs little per step."""
        assert self._prefilling is not None
        version = self._prefilling.version
        for req in islice(self.waiting, self.config.max_num_seqs):
            found = self._matches.get(req.request_id)
            if found is None or found[0] != version:
                length = self._prefilling.longest_match(req)
                owners = self._prefilling.holders(req, length) if length else []
                found = (version, length, owners)
                self._matches[req.request_id] = found
            _, length, owners = found
            for rid in owners:
                owner = self.requests[rid]
                if owner.num_computed_tokens < length:
                    self._ask_checkpoint(owner, length)

    def _checkpoint_where_waiting_leave(self, req: Request, computed: int) -> None:
        """req is being admitted while waiting requests share a prefix of its prompt: it
        saves a state checkpoint where they leave it, for them to hit."""
        assert self._waiting_prompts is not None
        length = self._waiting_prompts.longest_match(req)
        if length > computed:
            self._ask_checkpoint(req, length)

    def _ask_checkpoint(self, req: Request, position: int) -> None:
        """req saves a state checkpoint at `position` for another prompt, once per
        position and at most SHARED_CHECKPOINTS of them."""
        asked = self._asked.setdefault(req.request_id, set())
        if position not in asked and len(asked) < SHARED_CHECKPOINTS:
            asked.add(position)
            self.kv.want_checkpoint(req, position)

    def _preempted_alone(self, req: Request, target: int) -> None:
        """A request that cannot grow to `target` tokens with nothing else running cannot do
        so after a recompute either; the second time it happens it is given up on."""
        if self._alone_target.get(req.request_id, -1) >= target:
            self._never_fit(req)
        self._alone_target[req.request_id] = target

    def _never_fit(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self._never_fitting.append(req)

    def take_never_fitting(self) -> list[Request]:
        """Requests found this step to need more KV cache than exists; the caller finishes
        them (`finish`)."""
        found, self._never_fitting = self._never_fitting, []
        return found

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Free a running request for recompute; returns the tokens it had been scheduled
        in this step (now unscheduled)."""
        req.num_tokens_at_preemption = req.num_computed_tokens
        num_scheduled = out.num_scheduled_tokens.pop(req.request_id, 0)
        out.scheduled_spec_decode_tokens.pop(req.request_id, None)
        out.num_draft_slots.pop(req.request_id, None)
        req.spec_token_ids = []
        # Blocks cached for this step's tokens were never written: they leave the cache.
        self.kv.free(req, num_valid_tokens=req.num_computed_tokens if num_scheduled else None)
        out.state_checkpoints.pop(req.request_id, None)
        if num_scheduled:
            out.cached_requests = [c for c in out.cached_requests
                                   if c.request_id != req.request_id]
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if self._prefilling is not None and self._waiting_prompts is not None:
            self._prefilling.remove(req.request_id)
            self._waiting_prompts.add(req)
            self._asked.pop(req.request_id, None)  # forgotten with its blocks
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)
        self._num_sent_tokens.pop(req.request_id, None)
        out.preempted_request_ids.add(req.request_id)
        # Its worker state is rebuilt when it is admitted again.
        out.finished_request_ids.add(req.request_id)
        return num_scheduled

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           accepted: dict[str, list[int]] | None = None,
                           made: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance computed tokens, append sampled tokens (one per request whose prompt is
        complete, after the drafts the rejection sampler `accepted`), stop what is done.
        `made`: the drafts the worker made in the slots of `out.num_draft_slots`. Returns
        the requests that got new tokens (`num_new_tokens` of them).

        A rejected draft's KV is simply overwritten later (attention groups). State groups
        cannot rewind: the runner restores the state at the request's known tokens and the
        accepted drafts are computed again next step (replayed), unless all were accepted."""
        updated = []
        for rid, num in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue  # finished during the step (its sampling failed)
            drafts = out.scheduled_spec_decode_tokens.get(rid)
            if rid in out.num_draft_slots:
                drafts = (made or {}).get(rid, [])
                assert len(drafts) == out.num_draft_slots[rid], "a draft per reserved slot"
            kept: list[int] = []
            if drafts:
                kept = (accepted or {}).get(rid, [])
                assert kept == drafts[:len(kept)], "accepted tokens must be a draft prefix"
                rejected = len(drafts) - len(kept)
                replay = rejected > 0 and self.kv.replays_rejected_drafts
                num -= len(drafts) if replay else rejected
                req.num_drafts += 1
                req.num_draft_tokens += len(drafts)
                req.num_accepted_tokens += len(kept)
                req.spec_token_ids = []
                req.draft_backoff = 0 if kept else \
                    min(max(1, 2 * req.draft_backoff), DRAFT_BACKOFF_MAX)
                req.draft_pause = req.draft_backoff
                req.draft_limit = draft_limit(req.draft_limit, len(drafts), len(kept))
            req.num_computed_tokens += num
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk that does not finish the prompt samples nothing
            req.append_token_ids([*kept, sampled[rid]])
            req.num_new_tokens = len(kept) + 1
            updated.append(req)
        return updated

    def finish(self, requests: Iterable[Request], status: RequestStatus, *,
               computed: bool = True) -> None:
        """Free finished requests' blocks and tell the worker next step. `computed=False`:
        the step that was to compute their scheduled tokens failed, so the blocks of those
        tokens hold no valid KV and must not stay in the prefix cache."""
        for req in requests:
            req.status = status
            if self._prefilling is not None and self._waiting_prompts is not None:
                self._prefilling.remove(req.request_id)
                self._waiting_prompts.remove(req.request_id)
                self._matches.pop(req.request_id, None)
                self._asked.pop(req.request_id, None)
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.loading.pop(req.request_id, None)
            if self.connector is not None:
                self.connector.request_finished(req)
            self.kv.free(req, num_valid_tokens=None if computed else req.num_computed_tokens)
            self._num_sent_tokens.pop(req.request_id, None)
            self._alone_target.pop(req.request_id, None)
            self._finished_ids.add(req.request_id)
            del self.requests[req.request_id]


def draft_limit(limit: int, num_drafts: int, num_kept: int) -> int:
    """The most drafts a request takes after a step that scored `num_drafts` of them under
    `limit` and kept `num_kept`: one past the drafts kept after a rejection, twice the
    limit when all were kept. Every draft scored widens the step (~20% of a batch-1 step a
    row on Gemma 3 270M), and where text stops following its context the next drafts tend
    to miss too; drafts that keep being kept earn a longer run again, soon."""
    if num_kept < num_drafts:
        return num_kept + 1
    return min(2 * limit, MAX_SPECULATIVE_TOKENS)


def drafts_per_request(num_speculative_tokens: int, num_running: int) -> int:
    """The most drafts one request gets in a step with `num_running` running requests
    (DRAFT_TOKENS_PER_STEP); 0 with speculation off."""
    if num_speculative_tokens < 1:
        return 0
    return min(num_speculative_tokens, max(1, DRAFT_TOKENS_PER_STEP // max(1, num_running)))
