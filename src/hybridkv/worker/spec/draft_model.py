"""Drafts from a smaller model with the target's vocabulary (`speculative_config` method
`draft_model`), made by the runner at the start of each step in the slots the scheduler
reserved (`SchedulerOutput.num_draft_slots`), before the target scores them in the same step.

The draft model's layers are layers of the KV cache plan like the target's, named with
DRAFT_PREFIX: each joins the group of its kind (the same block ids, the same block table:
its pages sit beside the target's in each block), or a group of its own where the target
has no group of that kind. So the draft's KV of a position lies in the block the target's
does, is allocated, dropped (windows), cached and freed with it, and the planner counts it.

A request's draft KV is valid for its first `num_computed[rid]` positions. Each step:

    known tokens  t0 .. t(N-1)                    drafts  d0 .. d(k-1)
    catch-up      feed t(c_d) .. t(N-1)           (what the target computes this step of
                                                   its known tokens, plus the last draft
                                                   of a step that accepted every draft)
    propose       argmax -> d0; feed d0 -> d1; ... feed d(k-2) -> d(k-1)

so the draft writes positions up to N + k - 2, inside the N + k the target's step holds.
After verification `a` drafts are kept: positions N .. N + a - 1 hold accepted tokens,
so c_d = N + min(a, k - 1); the rejected drafts' slots are written again by the next
catch-up, which also feeds the correction (or bonus) token. No state to roll back: draft
models are attention-only (engine/draft.py refuses others).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from hybridkv.sched.scheduler import SchedulerOutput
from hybridkv.worker.forward_context import ForwardContext

if TYPE_CHECKING:
    from hybridkv.worker.model_runner import ModelRunner, RunnerOutput, StepInputs

# The draft model's layer names in the KV cache plan: its own names, prefixed.
DRAFT_PREFIX = "draft."


class DraftModel:
    def __init__(self, model: nn.Module, kv_caches: Mapping[str, Any],
                 layer_group: Mapping[str, int]) -> None:
        self.model = model
        # The draft's layers find their caches under their own names.
        self.kv_caches = {name.removeprefix(DRAFT_PREFIX): view
                          for name, view in kv_caches.items() if name.startswith(DRAFT_PREFIX)}
        self.layer_group = {name.removeprefix(DRAFT_PREFIX): group
                            for name, group in layer_group.items()
                            if name.startswith(DRAFT_PREFIX)}
        if not self.kv_caches:
            raise ValueError("the KV cache plan has no draft model layers (names starting "
                             f"{DRAFT_PREFIX!r})")
        self.num_computed: dict[str, int] = {}  # per request: positions of valid draft KV
        self._drafting: dict[str, tuple[int, int]] = {}  # this step: (known tokens, drafts)

    # Whether the runner hands this drafter the target's hidden state of every token it
    # computes (`target_forward`; the runner then computes them all: no row cut).
    reads_target_hidden: ClassVar[bool] = False

    def forget(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)

    def target_forward(self, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """The target's forward of this step ran: `hidden` [tokens, hidden], in `inputs`'
        order. A draft model reads none of it."""

    def step_done(self, runner: ModelRunner, result: RunnerOutput) -> None:
        """The step's tokens are known (`result`). A draft model has nothing left to do."""

    def propose(self, runner: ModelRunner, out: SchedulerOutput) -> dict[str, list[int]]:
        """Catch the draft up on every scheduled request's known tokens of this step, then
        draft `out.num_draft_slots[rid]` tokens greedily for those that have slots.
        Returns the drafts per request."""
        from hybridkv.worker.model_runner import StepInputs  # (it imports this module)

        scheduled = sorted(out.num_scheduled_tokens, key=runner.row_of.__getitem__)
        inputs = StepInputs([], [], [], [], [0], [], [], [], [])
        last: list[int] = []  # per drafting request: its last known token's row in `inputs`
        self._drafting = {}
        for rid in scheduled:
            tokens = runner.tokens[rid]
            if rid in runner._new_this_step:  # its prefix hit holds draft KV too
                self.num_computed[rid] = runner.num_computed[rid]
            start = self.num_computed.setdefault(rid, runner.num_computed[rid])
            end = min(runner.num_computed[rid] + out.num_scheduled_tokens[rid], len(tokens))
            if start < end:
                self._add(runner, inputs, rid, tokens[start:end], start)
                self.num_computed[rid] = end
            num = out.num_draft_slots.get(rid, 0)
            if num:
                assert start < end == len(tokens), f"request {rid} drafts mid-prompt"
                last.append(len(inputs.input_ids) - 1)
                self._drafting[rid] = (len(tokens), num)
        if not inputs.input_ids:
            return {}
        drafted = list(self._drafting)
        hidden = self._forward(runner, inputs)
        if not drafted:
            return {}
        next_ids = self._argmax(hidden[torch.tensor(last, device=hidden.device)])
        drafts: dict[str, list[int]] = {rid: [t] for rid, t in zip(drafted, next_ids,
                                                                  strict=True)}
        # One token per drafting request and pass, while it has slots left.
        while True:
            more = [rid for rid in drafted if len(drafts[rid]) < self._drafting[rid][1]]
            if not more:
                break
            inputs = StepInputs([], [], [], [], [0], [], [], [], [])
            for rid in more:
                known = self._drafting[rid][0]
                self._add(runner, inputs, rid, drafts[rid][-1:], known + len(drafts[rid]) - 1)
            for rid, token in zip(more, self._argmax(self._forward(runner, inputs)),
                                  strict=True):
                drafts[rid].append(token)
        for rid in drafted:  # written up to N + k - 2; the verification trims it
            known, num = self._drafting[rid]
            self.num_computed[rid] = known + num - 1
        return drafts

    def verified(self, accepted: Mapping[str, list[int]]) -> None:
        """After the target's verification: a request's draft KV stays valid up to its last
        accepted draft that the draft model was fed."""
        for rid, (known, num) in self._drafting.items():
            kept = accepted.get(rid)
            if kept is not None and rid in self.num_computed:
                self.num_computed[rid] = known + min(len(kept), num - 1)
        self._drafting = {}

    @staticmethod
    def _add(runner: ModelRunner, inputs: StepInputs, rid: str, token_ids: list[int],
             start: int) -> None:
        inputs.scheduled.append(rid)
        inputs.input_ids += token_ids
        inputs.positions += range(start, start + len(token_ids))
        inputs.token_rows += [runner.row_of[rid]] * len(token_ids)
        inputs.query_start_loc.append(len(inputs.input_ids))
        inputs.seq_lens.append(start + len(token_ids))

    def _forward(self, runner: ModelRunner, inputs: StepInputs,
                 *extra: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden]: one draft forward over `inputs`, writing their draft KV;
        `extra`: more per-token inputs of the drafter's model (an MTP head's hidden
        states)."""
        ctx = ForwardContext(runner.backend, self.kv_caches, runner._metadata(inputs, None),
                             self.layer_group, rope_tables=runner.rope_tables,
                             max_position=max(inputs.seq_lens) - 1)
        device = runner.device
        ids = torch.tensor(inputs.input_ids, dtype=torch.int64, device=device)
        positions = torch.tensor(inputs.positions, dtype=torch.int64, device=device)
        hidden: torch.Tensor = self.model(ids, positions, ctx, *extra)
        return hidden

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        """The draft's greedy token of each row of `hidden` [rows, hidden]."""
        logits = self.model.compute_logits(hidden)  # type: ignore[operator]
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
