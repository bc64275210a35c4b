"""The model runner: a persistent batch updated from the scheduler's diff, one block table
per group, attention metadata per group, one forward, sampling.

    runner = ModelRunner(model, kv_config, RunnerConfig(...))
    result = runner.execute(scheduler_output)     # one step: inputs, metadata, forward, sample
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from hybridkv.connector.base import ConnectorWorker
from hybridkv.connector.canonical import group_blocks
from hybridkv.kv.plan import KVCacheConfig
from hybridkv.kv.spec import KEY_GROUP, cdiv
from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.scheduler import SchedulerOutput
from hybridkv.sched.structured.manager import GrammarBitmask, StepGrammars
from hybridkv.worker.attention.backend import AttentionMetadata, get_backend
from hybridkv.worker.block_table import BlockTable
from hybridkv.worker.config import RunnerConfig
from hybridkv.worker.forward_context import ForwardContext, RopeTables
from hybridkv.worker.kv_cache import allocate_key_staging, allocate_kv_caches
from hybridkv.worker.sampling.rejection import Verified, verify_greedy, verify_sampled
from hybridkv.worker.sampling.sampler import Sampler, masked_rows
from hybridkv.worker.spec.draft_model import DraftModel
from hybridkv.worker.state import StateMetadata

# Called with (request ids, their logits [R, V]) every step that samples; tests compare the
# logits against a reference model through it.
LogitsHook = Callable[[Sequence[str], torch.Tensor], None]


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # one token per request whose known tokens are all computed
    logprobs: dict[str, dict[int, float]]
    # Requests that failed this step (their sampling raised): they get no token and are
    # finished with an error; everything else in the batch is unaffected.
    errors: dict[str, str] = field(default_factory=dict)
    # Per request that scored drafts: the drafts kept, which come before its sampled token.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    # The drafts the draft model made this step, per request with reserved draft slots.
    drafts: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepInputs:
    """The flattened batch of one step, in persistent-batch row order."""

    scheduled: list[str]  # request ids
    input_ids: list[int]
    positions: list[int]
    token_rows: list[int]  # each token's row in the block tables
    query_start_loc: list[int]  # per request, its first token in the flat batch (+ the end)
    seq_lens: list[int]  # per request, its tokens once this step is computed
    sample_ids: list[str]  # requests whose last known token is in this step: they sample
    # and where their sampled tokens are in the flat batch: the last known token, then
    # each draft (a request with k drafts samples k + 1 rows, in order)
    sample_indices: list[int]
    num_sample_rows: list[int]  # per sample_ids entry: 1 + its drafts


class ModelRunner:
    def __init__(self, model: nn.Module, kv_config: KVCacheConfig,
                 config: RunnerConfig) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(config.device)
        self.arena, self.kv_caches = allocate_kv_caches(kv_config, self.device)
        self.layer_group = {name: g.group_id for g in kv_config.groups
                            for name in (*g.layer_names, *g.shared_layer_names)}
        self.block_tables = [
            BlockTable(config.max_num_seqs, cdiv(config.max_model_len, g.block_size) + 1,
                       g.block_size, config.kernel_block_size)
            for g in kv_config.groups]
        self.blocks_per_page = [g.blocks_per_large_page for g in kv_config.groups]
        self.is_state_group = [g.spec.is_state for g in kv_config.groups]
        # State groups' blocks, whole (a state block is one byte range of all its layers).
        self.state_blocks = {g.group_id: group_blocks(self.arena, g)
                             for g in kv_config.groups if g.spec.is_state}
        # Quantized pages (None: pages in the model dtype), one dtype per group.
        self.cache_dtypes = [getattr(g.spec, "cache_dtype", None) for g in kv_config.groups]
        # q4 K/V pages: per group and layer, each row's unfinished key group in full
        # precision (worker/attention/backend.py), and the position up to which a row's staged keys
        # are its request's (a request must not start inside a group it has not staged).
        self.key_staging = allocate_key_staging(kv_config, self.kv_caches,
                                                config.max_num_seqs, self.device)
        self.staged_until = [0] * config.max_num_seqs
        self.shared_views = frozenset(self.kv_caches[target].data_ptr()
                                      for g in kv_config.groups for _, target in g.shared_layers)
        for group_id in self.key_staging:
            if self.block_tables[group_id].kernel_block_size % KEY_GROUP:
                raise ValueError(f"kv_cache_dtype 'q4' needs kernel blocks of a multiple of "
                                 f"{KEY_GROUP} tokens, got "
                                 f"{self.block_tables[group_id].kernel_block_size}")
        self.backend = get_backend(config.attention_backend, self.device)
        self.sampler = Sampler()
        self.rope_tables = RopeTables()
        self.logits_hook: LogitsHook | None = None
        # A KV connector's worker half (offload tiers), registered on this arena.
        self.connector: ConnectorWorker | None = None
        # The persistent batch: row -> request, in one order shared by every group.
        self.rows: list[str] = []
        self.row_of: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.num_prompt: dict[str, int] = {}
        self._new_this_step: set[str] = set()
        self.drafts: dict[str, list[int]] = {}  # this step's draft tokens per request
        self._checkpoints: dict[str, tuple[tuple[int, int, int], ...]] = {}
        # speculative_config method draft_model: its drafts fill the reserved draft slots.
        self.draft: DraftModel | None = None

    # ---------------------------------------------------------------- the diff
    def _remove(self, rid: str) -> None:
        row = self.row_of.pop(rid)
        last = len(self.rows) - 1
        if row != last:  # keep rows dense: the last request moves into the hole
            moved = self.rows[last]
            self.rows[row] = moved
            self.row_of[moved] = row
            for table in self.block_tables:
                table.move_row(last, row)
            for layers in self.key_staging.values():
                for staging in layers.values():
                    staging[row] = staging[last]
            self.staged_until[row] = self.staged_until[last]
        self.rows.pop()
        del self.tokens[rid], self.num_computed[rid], self.params[rid], self.num_prompt[rid]
        self.sampler.forget(rid)
        if self.draft is not None:
            self.draft.forget(rid)

    def _apply(self, out: SchedulerOutput) -> None:
        self._new_this_step = {new.request_id for new in out.new_requests}
        self.drafts = out.scheduled_spec_decode_tokens
        self._checkpoints = out.state_checkpoints
        for rid in out.finished_request_ids:
            if rid in self.row_of:
                self._remove(rid)
        for new in out.new_requests:
            row = len(self.rows)
            self.rows.append(new.request_id)
            self.row_of[new.request_id] = row
            self.tokens[new.request_id] = list(new.token_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
            self.params[new.request_id] = new.sampling_params
            self.num_prompt[new.request_id] = new.num_prompt_tokens
            self.staged_until[row] = 0
            for table, block_ids in zip(self.block_tables, new.block_ids, strict=True):
                table.set_row(row, block_ids)
        for cached in out.cached_requests:
            row = self.row_of[cached.request_id]
            self.tokens[cached.request_id].extend(cached.new_token_ids)
            self.num_computed[cached.request_id] = cached.num_computed_tokens
            for table, block_ids in zip(self.block_tables, cached.new_block_ids, strict=True):
                table.append(row, block_ids)

    def _history(self, rid: str) -> tuple[list[int], int]:
        """A request's tokens so far and how many are its prompt (for penalties)."""
        return self.tokens[rid], self.num_prompt[rid]

    def _state_metadata(self, group_id: int, table: BlockTable, blocks_per_page: int,
                        scheduled: list[str], query_start_loc: list[int],
                        out: SchedulerOutput) -> StateMetadata:
        """Where each request's live state is, where it starts from, what it saves."""
        def place(block: int) -> tuple[int, int]:
            return block // blocks_per_page, block % blocks_per_page

        live, init_from, checkpoints = [], [], []
        for rid in scheduled:
            row = self.row_of[rid]
            last = table.block_from_end(row, 1)
            assert last is not None, f"request {rid} has no state block"
            live.append(place(last))
            # A request new to the worker that starts past 0 starts from a prefix hit: its
            # row is [null..., checkpoint, live].
            source = table.block_from_end(row, 2) or 0
            starts_from_hit = rid in self._new_this_step and self.num_computed[rid] > 0
            init_from.append(place(source) if starts_from_hit and source else None)
            # With drafts, one of them is at its known tokens (kv/managers/mamba.py).
            checkpoints.append([
                (position - self.num_computed[rid], *place(block))
                for group, position, block in out.state_checkpoints.get(rid, ())
                if group == group_id])
        return StateMetadata(
            query_start_loc=query_start_loc, state_pages=[p for p, _ in live],
            state_slots=[s for _, s in live],
            has_initial_state=[self.num_computed[r] > 0 for r in scheduled],
            init_from=init_from, checkpoints=checkpoints)

    @staticmethod
    def _sampled_tokens_metadata(metadata: list[AttentionMetadata | StateMetadata | None],
                                 scheduled: list[str], sampled: dict[str, int],
                                 sample_t: torch.Tensor) -> list[AttentionMetadata | None]:
        """Attention metadata of the batch cut down to the sampled tokens: each request keeps
        its last `sampled[rid]` tokens (the last at position seq_len - 1; more than one with
        drafts) if it samples this step and nothing otherwise; sequence lengths and block
        tables stay, so those tokens still see their whole context. State groups get None:
        no state layer may run on this batch."""
        loc = [0]
        for rid in scheduled:
            loc.append(loc[-1] + sampled.get(rid, 0))
        return [AttentionMetadata(
            query_start_loc=loc, seq_lens=meta.seq_lens, block_table=meta.block_table,
            slot_mapping=meta.slot_mapping[sample_t], block_size=meta.block_size,
            kernel_block_size=meta.kernel_block_size, blocks_per_page=meta.blocks_per_page,
            cache_dtype=meta.cache_dtype, key_groups=meta.key_groups, staging=meta.staging,
            stage_rows=meta.stage_rows, fresh=meta.fresh, shared_views=meta.shared_views,
            prompt_lens=meta.prompt_lens)
            if isinstance(meta, AttentionMetadata) else None for meta in metadata]

    # ---------------------------------------------------------------- one step
    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        scheduled = sorted(out.num_scheduled_tokens, key=self.row_of.__getitem__)
        inputs = StepInputs(scheduled, [], [], [], [0], [], [], [], [])
        for rid in scheduled:
            start, num = self.num_computed[rid], out.num_scheduled_tokens[rid]
            drafts = self.drafts.get(rid, [])
            tokens = self.tokens[rid] + drafts if drafts else self.tokens[rid]
            inputs.input_ids += tokens[start:start + num]
            inputs.positions += range(start, start + num)
            inputs.token_rows += [self.row_of[rid]] * num
            inputs.query_start_loc.append(len(inputs.input_ids))
            inputs.seq_lens.append(start + num)
            if start + num == len(tokens):  # its last known token: sample the next one
                # E.g. 2 drafts: rows of the last known token, draft 0, draft 1.
                rows = 1 + len(drafts)
                inputs.sample_ids.append(rid)
                inputs.num_sample_rows.append(rows)
                end = len(inputs.input_ids)
                inputs.sample_indices += range(end - rows, end)
        return inputs

    def _metadata(self, inputs: StepInputs, out: SchedulerOutput | None
                  ) -> list[AttentionMetadata | StateMetadata | None]:
        """Per group: attention metadata (block table rows, slot mapping) or state metadata
        (None for state groups with `out` None: a batch no state layer runs on, the draft
        model's)."""
        pos_t = torch.tensor(inputs.positions, dtype=torch.int64)
        rows_t = torch.tensor(inputs.token_rows, dtype=torch.int64)
        batch_rows = torch.tensor([self.row_of[r] for r in inputs.scheduled],
                                  dtype=torch.int64)
        metadata: list[AttentionMetadata | StateMetadata | None] = []
        stage_rows = self._stage_rows(inputs) if self.key_staging else None
        for table, blocks_per_page, is_state, cache_dtype in zip(
                self.block_tables, self.blocks_per_page, self.is_state_group,
                self.cache_dtypes, strict=True):
            if is_state:
                metadata.append(None if out is None else self._state_metadata(
                    len(metadata), table, blocks_per_page, inputs.scheduled,
                    inputs.query_start_loc, out))
                continue
            kernel = table.kernel_table(len(self.rows))
            metadata.append(AttentionMetadata(
                query_start_loc=inputs.query_start_loc, seq_lens=inputs.seq_lens,
                block_table=kernel[batch_rows].to(self.device),
                slot_mapping=table.slot_mapping(rows_t, pos_t).to(self.device),
                block_size=table.block_size, kernel_block_size=table.kernel_block_size,
                blocks_per_page=blocks_per_page, cache_dtype=cache_dtype,
                key_groups=len(metadata) in self.key_staging,
                staging=self.key_staging.get(len(metadata)), stage_rows=stage_rows,
                shared_views=self.shared_views,
                prompt_lens=[self.num_prompt[r] for r in inputs.scheduled]))
        return metadata

    def _stage_rows(self, inputs: StepInputs) -> list[int]:
        """Each scheduled request's staging row (its batch row); checks that a request
        starting inside a key group staged that group's earlier keys."""
        rows = []
        for rid, seq_len in zip(inputs.scheduled, inputs.seq_lens, strict=True):
            row = self.row_of[rid]
            first = self.num_computed[rid]
            if first % KEY_GROUP and self.staged_until[row] != first:
                raise RuntimeError(
                    f"request {rid} resumes at position {first}, inside a q4 key group whose "
                    f"earlier keys were not staged (staged up to {self.staged_until[row]})")
            self.staged_until[row] = seq_len
            rows.append(row)
        return rows

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One step. The connector copies out blocks evicted this step before the forward
        reuses them and starts loads; after the forward, it copies out the blocks it filled
        (only if it ran: a failed forward wrote nothing valid)."""
        meta = out.kv_connector_meta if self.connector is not None else None
        if meta is None or self.connector is None:
            return self._execute(out)
        self.connector.before_forward(meta)
        ok = False
        try:
            result = self._execute(out)
            ok = True
        finally:
            self.connector.after_forward(meta, ok)
        return result

    def _all_plain_greedy(self, sample_ids: list[str]) -> bool:
        """Whether the sampler would take a plain argmax of every row's logits (masked, for
        structured-output rows) and return nothing else (no logprobs, bias or penalties; no
        hook reading the logits)."""
        if self.logits_hook is not None:
            return False
        return all(self.params[r].plain_argmax and self.params[r].logprobs is None
                   for r in sample_ids)

    # A constrained greedy row takes the first of its head's top candidates that its
    # grammar allows. With 8, ~93% of Gemma 3 270M's rows under a JSON schema need no mask;
    # the others mostly have few allowed tokens (after `[` only `"` may come).
    GRAMMAR_CANDIDATES = 8

    def _greedy_step(self, hidden: torch.Tensor, sample_ids: list[str],
                     grammars: StepGrammars | None) -> list[int] | None:
        """Every row greedy: tokens from the blocked head's top candidates, the [rows,
        vocab] logits never written; None where the model cannot (the caller then takes
        the full logits). A constrained row whose candidates the grammar all refuses gets
        its mask, and the logits of the tokens the mask allows (or its whole row's, when
        the mask allows many). `sample_ids` names each row's request (one with drafts has
        several rows, never a grammar); returns a token per row."""
        find = getattr(self.model, "head_candidates", None)
        if find is None:
            return None
        found = find(hidden, self.GRAMMAR_CANDIDATES if grammars is not None else 1)
        if found is None or bool(found.nan.any()):
            return None
        ids = found.ids.tolist()
        tokens: list[int | None] = [None] * len(sample_ids)
        rest: list[int] = []  # rows that need their mask
        for row, rid in enumerate(sample_ids):
            if grammars is None or rid not in grammars:
                tokens[row] = ids[row][0]
                continue
            for j, token in enumerate(ids[row]):
                if token >= 0 and grammars.allows(rid, token):
                    if found.complete(row, j):
                        tokens[row] = token
                    break
            if tokens[row] is None:
                rest.append(row)
        if rest:
            assert grammars is not None
            masked = self._masked_greedy(hidden, [sample_ids[r] for r in rest], rest,
                                         grammars)
            for row in rest:
                tokens[row] = masked[sample_ids[row]]
        return [t for t in tokens if t is not None]

    # A row allowing at most this many tokens gets their logits from their head rows alone.
    GATHER_MAX_TOKENS = 4096

    def _masked_greedy(self, hidden: torch.Tensor, rids: list[str], rows: list[int],
                       grammars: StepGrammars) -> dict[str, int]:
        """argmax over each row's allowed tokens, from the head rows of those tokens alone
        where the model can compute them (a handful of 262k, typically), else from the
        row's full logits masked. The first allowed index wins a tie, as in the sampler."""
        bitmask = grammars.bitmask(rids)
        tokens: dict[str, int] = {}
        logits_at = getattr(self.model, "logits_at", None)
        for i, (rid, row) in enumerate(zip(rids, rows, strict=True)):
            allowed = np.flatnonzero(np.unpackbits(bitmask.words[i].view(np.uint8),
                                                   bitorder="little"))
            if logits_at is not None and 0 < len(allowed) <= self.GATHER_MAX_TOKENS:
                ids = torch.from_numpy(allowed).to(hidden.device)
                values = logits_at(hidden[row], ids)
                if values is not None:
                    tokens[rid] = int(ids[int(torch.argmax(values))])
                    continue
            logits = self.model.compute_logits(  # type: ignore[operator]
                hidden[row:row + 1]).float()
            _, masked = masked_rows(GrammarBitmask([rid], bitmask.words[i:i + 1]), [rid],
                                     logits)
            tokens[rid] = int(torch.argmax(masked[0]))
        return tokens

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = self._step(out)
        if self.draft is not None:  # an MTP head catches up on what the step computed
            self.draft.step_done(self, result)
        return result

    def _step(self, out: SchedulerOutput) -> RunnerOutput:
        self._apply(out)
        if self.draft is not None:  # its drafts, scheduled after the known tokens
            self.drafts = self.draft.propose(self, out)
        inputs = self._prepare_inputs(out)
        if not inputs.input_ids:
            return RunnerOutput({}, {})
        metadata = self._metadata(inputs, out)
        ctx = ForwardContext(self.backend, self.kv_caches, metadata, self.layer_group,
                             rope_tables=self.rope_tables, max_position=max(inputs.seq_lens) - 1)
        sample_t = torch.tensor(inputs.sample_indices, dtype=torch.int64, device=self.device)
        # Only when some tokens are not sampled (prefill): a pure decode step has none to cut.
        # A drafter reading the target's hidden states (an MTP head) needs every row.
        cut = len(inputs.sample_indices) < len(inputs.input_ids) and not (
            self.draft is not None and self.draft.reads_target_hidden)
        reduced = self.config.kv_sharing_fast_prefill and cut
        if cut:
            sampled_ctx = ForwardContext(
                self.backend, self.kv_caches,
                self._sampled_tokens_metadata(
                    metadata, inputs.scheduled,
                    dict(zip(inputs.sample_ids, inputs.num_sample_rows, strict=True)),
                    sample_t),
                self.layer_group, rope_tables=self.rope_tables,
                max_position=ctx.max_position)
            if reduced:
                ctx.kv_shared_tokens, ctx.kv_shared_ctx = sample_t, sampled_ctx
            else:
                ctx.sampled_tokens, ctx.sampled_ctx = sample_t, sampled_ctx
        ids_t = torch.tensor(inputs.input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(inputs.positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids_t, pos_t, ctx)
        if self.draft is not None:
            self.draft.target_forward(inputs, hidden)
        if not inputs.sample_ids:
            return RunnerOutput({}, {})
        # Cut down to the sampled tokens, the model returns only their rows, in order.
        sampled_hidden = hidden if reduced or ctx.rows_cut else hidden[sample_t]
        row_ids = [rid for rid, n in zip(inputs.sample_ids, inputs.num_sample_rows,
                                         strict=True) for _ in range(n)]
        if self._all_plain_greedy(inputs.sample_ids):
            # Every row takes the argmax of the model's own logits (masked, where a grammar
            # holds it) and nothing reads them: the model may reduce its head a block at a
            # time (a [rows, 262k] float32 tensor is 1 MiB a row, written and read again by
            # the argmax otherwise).
            tokens = self._greedy_step(sampled_hidden, row_ids, out.grammars)
            if tokens is not None:
                return self._verify(inputs, tokens, RunnerOutput({}, {}))
        logits = self.model.compute_logits(sampled_hidden)  # type: ignore[operator]
        if not self.drafts:
            if self.logits_hook is not None:
                self.logits_hook(inputs.sample_ids, logits)
            sampled = self.sampler.sample(logits, inputs.sample_ids,
                                          [self.params[r] for r in inputs.sample_ids],
                                          self._history, out.grammars)
            return RunnerOutput(sampled.tokens, sampled.logprobs, sampled.errors)
        # Requests without drafts sample as usual; those with drafts (no penalties, logprobs
        # or grammar: the scheduler drafts for no other) are verified on their rows.
        plain = [row for row, rid in enumerate(row_ids) if rid not in self.drafts]
        plain_ids = [row_ids[row] for row in plain]
        plain_logits = logits[torch.tensor(plain, dtype=torch.int64, device=logits.device)]
        if self.logits_hook is not None:
            self.logits_hook(plain_ids, plain_logits)
        sampled = self.sampler.sample(plain_logits, plain_ids,
                                      [self.params[r] for r in plain_ids], self._history,
                                      out.grammars)
        result = RunnerOutput(sampled.tokens, sampled.logprobs, sampled.errors)
        return self._verify(inputs, logits, result)

    def _verify(self, inputs: StepInputs, rows: list[int] | torch.Tensor,
                result: RunnerOutput) -> RunnerOutput:
        """Each sampled row's token (a list), or its logits [rows, V] -> the requests'
        tokens: a request without drafts takes its row's token (unless `result` has it
        already), one with drafts keeps the drafts its rows accept and the token after
        them. A state group whose request rejected a draft gets back the state saved at the
        request's known tokens."""
        row = 0
        rejected = []
        for rid, num_rows in zip(inputs.sample_ids, inputs.num_sample_rows, strict=True):
            drafts = self.drafts.get(rid)
            if drafts:
                try:
                    verified = self._verify_drafts(rid, drafts, rows[row:row + num_rows])
                except Exception as e:  # reported for this request alone, as sampling is
                    result.errors[rid] = f"verifying drafts failed: {type(e).__name__}: {e}"
                    row += num_rows
                    continue
                result.sampled[rid] = verified.token
                result.accepted[rid] = verified.accepted
                if len(verified.accepted) < len(drafts):
                    rejected.append(rid)
            elif rid not in result.sampled and rid not in result.errors:
                assert isinstance(rows, list)
                result.sampled[rid] = rows[row]
            row += num_rows
        if rejected and self.state_blocks:
            self._restore_states(rejected)
        if self.draft is not None:
            result.drafts = self.drafts
            self.draft.verified(result.accepted)
        return result

    def _verify_drafts(self, rid: str, drafts: list[int],
                       rows: list[int] | torch.Tensor) -> Verified:
        """One request's drafts against its k + 1 rows: tokens (greedy on the model's own
        logits), or logits (with its bias; greedy by argmax, sampled by speculative
        sampling)."""
        if isinstance(rows, list):
            return verify_greedy(drafts, rows)
        params = self.params[rid]
        target = self.sampler.target_rows(rows, rid, params)
        if params.greedy:
            return verify_greedy(drafts, torch.argmax(target, dim=-1).tolist())
        return verify_sampled(drafts, target,
                              self.sampler.generator(rid, params, target.device))

    def _restore_states(self, request_ids: list[str]) -> None:
        """Copy each request's state at its known tokens (the checkpoint this step saved
        there) over its live state: the drafts it rejected are undone, and the ones it
        accepted are computed again next step (the scheduler replays them)."""
        for group_id, blocks in self.state_blocks.items():
            table, per_page = self.block_tables[group_id], self.blocks_per_page[group_id]
            for rid in request_ids:
                known = len(self.tokens[rid])
                saved = next((block for group, position, block in self._checkpoints[rid]
                              if group == group_id and position == known), None)
                live = table.block_from_end(self.row_of[rid], 1)
                assert saved is not None and live is not None, \
                    f"request {rid} drafted without a checkpoint at its known tokens"
                blocks[live // per_page, live % per_page].copy_(
                    blocks[saved // per_page, saved % per_page])
