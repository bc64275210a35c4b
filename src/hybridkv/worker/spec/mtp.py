"""Drafts from the target's own multi-token-prediction head (`speculative_config` method
`mtp`): the draft-model machinery (worker/spec/draft_model.py: its layer in the KV cache plan
under DRAFT_PREFIX, drafts in the slots the scheduler reserves, rollback by overwriting)
with a head that reads the target's last hidden state instead of running a model of its own.

The head at position p takes the target's hidden state h[p] and token t[p + 1], writes its
attention KV at p, and its output g[p] predicts t[p + 2]. Its KV is valid for positions
< `num_computed[rid]`: those fed with the target's h. Per step:

    step start (propose)    d0 = argmax(g[N-2])            N known tokens; g[N-2] kept from
                            feed (g[N-2], d0) at N-1 -> d1  the previous step's end
                            feed (g', d1) at N -> d2 ...    (its own output stands in for h:
                                                            KV at N-1.. is provisional)
                            (a request whose known tokens the target has yet to compute is
                            fed them this way first, from its latest output)
    target forward          h of every token it computed (no row cut), kept for the end
    step end (step_done)    feed (h[p], t[p+1]) for p from num_computed up to the last
                            position whose next token is now known (accepted drafts and the
                            sampled token included) -> g of the last one kept for drafting

So the head's pages of a block are written in the step the target writes its pages (a block
cached at that step holds both), and the provisional KV of the drafts is overwritten by the
catch-up before anything reads it. No second target pass: the hidden states come from the
forward that verified the drafts. A state target's replay (a rejected draft makes the
scheduler compute the accepted ones again) needs nothing here: the positions replayed were
caught up on already, and their rows are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from hybridkv.sched.scheduler import SchedulerOutput
from hybridkv.worker.spec.draft_model import DraftModel

if TYPE_CHECKING:
    from hybridkv.worker.model_runner import ModelRunner, RunnerOutput, StepInputs


class MTPDrafter(DraftModel):
    reads_target_hidden: ClassVar[bool] = True

    def __init__(self, model: nn.Module, kv_caches: Mapping[str, Any],
                 layer_group: Mapping[str, int]) -> None:
        super().__init__(model, kv_caches, layer_group)
        self._target: tuple[StepInputs, torch.Tensor] | None = None  # this step's forward
        # Per request: the head's output at the last position it was fed the target's
        # hidden state there, (position, [hidden]): what its next first draft comes from.
        self.last: dict[str, tuple[int, torch.Tensor]] = {}

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.last.pop(request_id, None)

    def target_forward(self, inputs: StepInputs, hidden: torch.Tensor) -> None:
        self._target = (inputs, hidden)

    def propose(self, runner: ModelRunner, out: SchedulerOutput) -> dict[str, list[int]]:
        """`out.num_draft_slots[rid]` drafts per request that has slots, recurrently: the
        head's output at position q predicts token q + 2, so from its last output it is fed
        the known tokens the target has not computed yet (a preempted request recomputing
        its output tokens drafts meanwhile), then its own drafts."""
        from hybridkv.worker.model_runner import StepInputs  # (it imports this module)

        slots = {rid: n for rid, n in out.num_draft_slots.items() if n > 0}
        order = sorted(slots, key=runner.row_of.__getitem__)
        position: dict[str, int] = {}  # of the head's latest output per request
        output: dict[str, torch.Tensor] = {}  # [hidden]
        for rid in order:
            last = self.last.get(rid)
            # Slots go to requests the target ran for in an earlier step, and each step's
            # end fed the head what that step computed.
            assert last is not None and last[0] <= len(runner.tokens[rid]) - 2, \
                f"request {rid}: the MTP head has no output to draft from"
            position[rid], output[rid] = last
        drafts: dict[str, list[int]] = {rid: [] for rid in order}
        # E.g. N known tokens: the output at N - 2 gives draft 0, at N - 1 draft 1, ...
        self._emit([r for r in order if position[r] == len(runner.tokens[r]) - 2],
                   output, drafts)
        while True:  # one token per request and pass, while it has slots left
            more = [rid for rid in order if len(drafts[rid]) < slots[rid]]
            if not more:
                return drafts
            inputs = StepInputs([], [], [], [], [0], [], [], [], [])
            for rid in more:
                tokens = runner.tokens[rid] + drafts[rid]
                self._add(runner, inputs, rid, [tokens[position[rid] + 2]], position[rid] + 1)
            hidden = self._forward(runner, inputs, torch.stack([output[r] for r in more]))
            for row, rid in enumerate(more):
                position[rid] += 1
                output[rid] = hidden[row]
            self._emit([r for r in more if position[r] >= len(runner.tokens[r]) - 2],
                       output, drafts)

    def _emit(self, rids: list[str], output: dict[str, torch.Tensor],
              drafts: dict[str, list[int]]) -> None:
        """Each request's next draft: the greedy token of the head's latest output."""
        if rids:
            tokens = self._argmax(torch.stack([output[r] for r in rids]))
            for rid, token in zip(rids, tokens, strict=True):
                drafts[rid].append(token)

    def step_done(self, runner: ModelRunner, result: RunnerOutput) -> None:
        """Feed the head every position the target computed this step whose next token is
        known now, from where its valid KV ends; keep its last output per request."""
        from hybridkv.worker.model_runner import StepInputs  # (it imports this module)

        target, self._target = self._target, None
        if target is None:
            return
        step, hidden = target
        inputs = StepInputs([], [], [], [], [0], [], [], [], [])
        rows: list[int] = []  # the target's rows fed, in order
        ends: list[int] = []  # per request fed: its first position not fed
        for i, rid in enumerate(step.scheduled):
            if rid in result.errors:
                continue  # finished with its error
            first_row, end_row = step.query_start_loc[i], step.query_start_loc[i + 1]
            first = step.positions[first_row]
            known = runner.tokens[rid]
            if rid in result.sampled:
                known = [*known, *result.accepted.get(rid, []), result.sampled[rid]]
            if rid in runner._new_this_step:  # a prefix hit holds the head's KV too
                self.num_computed[rid] = first
            start = self.num_computed.setdefault(rid, first)
            assert start >= first, f"request {rid}: positions {start}..{first} were never fed"
            # E.g. computed 10..14, 13 tokens known -> feed p = start .. 11 (t[12] known).
            end = min(first + end_row - first_row, len(known) - 1)
            if start >= end:
                continue
            self._add(runner, inputs, rid, known[start + 1:end + 1], start)
            rows += range(first_row + start - first, first_row + end - first)
            ends.append(end)
        if not rows:
            return
        fed = hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)]
        out = self._forward(runner, inputs, fed)  # [rows, hidden]
        for j, (rid, end) in enumerate(zip(inputs.scheduled, ends, strict=True)):
            self.num_computed[rid] = end
            # A copy: the step's output buffer is not the head's to keep.
            self.last[rid] = (end - 1, out[inputs.query_start_loc[j + 1] - 1].clone())
