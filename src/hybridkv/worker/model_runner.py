"""The model runner: a persistent batch updated from the scheduler's diff, one block table
per group, attention metadata per group, one forward, sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.kv.plan import KVCacheConfig
from hybridkv.kv.spec import MambaSpec, cdiv
from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.scheduler import SchedulerOutput
from hybridkv.worker.attention import AttentionMetadata, get_backend
from hybridkv.worker.block_table import BlockTable
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.kv_cache import allocate_kv_caches
from hybridkv.worker.sampler import Sampler
from hybridkv.worker.state import StateMetadata


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # one token per request whose known tokens are all computed
    logprobs: dict[str, dict[int, float]]
    logits: dict[str, torch.Tensor]  # the sampled rows' logits, kept when asked (tests)


class ModelRunner:
    def __init__(self, model: nn.Module, kv_config: KVCacheConfig, *, max_num_reqs: int,
                 max_model_len: int, device: torch.device, attention_backend: str = "torch",
                 kernel_block_size: int | None = None, keep_logits: bool = False,
                 kv_sharing_fast_prefill: bool = False) -> None:
        self.model = model
        # Run the model's KV-sharing layers on the sampled tokens only (see ForwardContext).
        self.kv_sharing_fast_prefill = kv_sharing_fast_prefill
        self.device = device
        self.keep_logits = keep_logits
        self.arena, self.kv_caches = allocate_kv_caches(kv_config, device)
        self.layer_group = {name: g.group_id for g in kv_config.groups
                            for name in (*g.layer_names, *g.shared_layer_names)}
        self.block_tables = [
            BlockTable(max_num_reqs, cdiv(max_model_len, g.block_size) + 1, g.block_size,
                       kernel_block_size) for g in kv_config.groups]
        self.blocks_per_page = [g.blocks_per_large_page for g in kv_config.groups]
        self.is_state_group = [isinstance(g.spec, MambaSpec) for g in kv_config.groups]
        self.backend = get_backend(attention_backend)
        self.sampler = Sampler()
        # The persistent batch: row -> request, in one order shared by every group.
        self.rows: list[str] = []
        self.row_of: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self._new_this_step: set[str] = set()

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
        self.rows.pop()
        del self.tokens[rid], self.num_computed[rid]
        self.sampler.forget(rid)

    def _apply(self, out: SchedulerOutput) -> None:
        self._new_this_step = {new.request_id for new in out.new_requests}
        for rid in out.finished_request_ids:
            if rid in self.row_of:
                self._remove(rid)
        for new in out.new_requests:
            row = len(self.rows)
            self.rows.append(new.request_id)
            self.row_of[new.request_id] = row
            self.tokens[new.request_id] = list(new.token_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
            for table, block_ids in zip(self.block_tables, new.block_ids, strict=True):
                table.set_row(row, block_ids)
        for cached in out.cached_requests:
            row = self.row_of[cached.request_id]
            self.tokens[cached.request_id].extend(cached.new_token_ids)
            self.num_computed[cached.request_id] = cached.num_computed_tokens
            for table, block_ids in zip(self.block_tables, cached.new_block_ids, strict=True):
                table.append(row, block_ids)

    def _state_metadata(self, group_id: int, table: BlockTable, blocks_per_page: int,
                        scheduled: list[str], query_start_loc: list[int],
                        out: SchedulerOutput) -> StateMetadata:
        """Where each request's live state is, where it starts from, what it saves."""
        def place(block: int) -> tuple[int, int]:
            return block // blocks_per_page, block % blocks_per_page

        live, init_from, checkpoints = [], [], []
        for rid in scheduled:
            row = self.row_of[rid]
            n = table.num_blocks[row]
            live.append(place(int(table.table[row, n - 1])))  # the last block of the row
            # A request new to the worker that starts past 0 starts from a prefix hit: its
            # row is [null..., checkpoint, live].
            source = int(table.table[row, n - 2]) if n >= 2 else 0
            starts_from_hit = rid in self._new_this_step and self.num_computed[rid] > 0
            init_from.append(place(source) if starts_from_hit and source else None)
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
    def _sampled_tokens_metadata(metadata: list[AttentionMetadata | StateMetadata],
                                 scheduled: list[str], sampled: set[str],
                                 sample_t: torch.Tensor) -> list[AttentionMetadata | None]:
        """Attention metadata of the batch cut down to the sampled tokens: each request keeps
        its last token (the one at position seq_len - 1) if it samples this step and nothing
        otherwise; sequence lengths and block tables stay, so those tokens still see their
        whole context. State groups get None: no state layer may run on this batch."""
        loc = [0]
        for rid in scheduled:
            loc.append(loc[-1] + (rid in sampled))
        return [AttentionMetadata(
            query_start_loc=loc, seq_lens=meta.seq_lens, block_table=meta.block_table,
            slot_mapping=meta.slot_mapping[sample_t], block_size=meta.block_size,
            kernel_block_size=meta.kernel_block_size, blocks_per_page=meta.blocks_per_page)
            if isinstance(meta, AttentionMetadata) else None for meta in metadata]

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, params: dict[str, SamplingParams]) -> RunnerOutput:
        self._apply(out)
        scheduled = sorted(out.num_scheduled_tokens, key=self.row_of.__getitem__)
        input_ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_ids: list[str] = []
        sample_indices: list[int] = []
        for rid in scheduled:
            start, num = self.num_computed[rid], out.num_scheduled_tokens[rid]
            tokens = self.tokens[rid]
            input_ids += tokens[start:start + num]
            positions += range(start, start + num)
            token_rows += [self.row_of[rid]] * num
            query_start_loc.append(len(input_ids))
            seq_lens.append(start + num)
            if start + num == len(tokens):  # its last known token: sample the next one
                sample_ids.append(rid)
                sample_indices.append(len(input_ids) - 1)
        if not input_ids:
            return RunnerOutput({}, {}, {})
        ids_t = torch.tensor(input_ids, dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        rows_t = torch.tensor(token_rows, dtype=torch.int64)
        batch_rows = torch.tensor([self.row_of[r] for r in scheduled], dtype=torch.int64)
        metadata: list[AttentionMetadata | StateMetadata] = []
        for table, blocks_per_page, is_state in zip(self.block_tables, self.blocks_per_page,
                                                    self.is_state_group, strict=True):
            if is_state:
                metadata.append(self._state_metadata(
                    len(metadata), table, blocks_per_page, scheduled, query_start_loc, out))
                continue
            kernel = table.kernel_table(len(self.rows))
            metadata.append(AttentionMetadata(
                query_start_loc=query_start_loc, seq_lens=seq_lens,
                block_table=kernel[batch_rows].to(self.device),
                slot_mapping=table.slot_mapping(rows_t, pos_t).to(self.device),
                block_size=table.block_size, kernel_block_size=table.kernel_block_size,
                blocks_per_page=blocks_per_page))
        ctx = ForwardContext(self.backend, self.kv_caches, metadata, self.layer_group)
        sample_t = torch.tensor(sample_indices, dtype=torch.int64, device=self.device)
        # Only when some tokens are not sampled (prefill): a pure decode step has none to cut.
        reduced = self.kv_sharing_fast_prefill and len(sample_indices) < len(input_ids)
        if reduced:
            sampled = set(sample_ids)
            ctx.kv_shared_tokens = sample_t
            ctx.kv_shared_ctx = ForwardContext(
                self.backend, self.kv_caches,
                self._sampled_tokens_metadata(metadata, scheduled, sampled, sample_t),
                self.layer_group)
        hidden = self.model(ids_t.to(self.device), pos_t.to(self.device), ctx)
        if not sample_ids:
            return RunnerOutput({}, {}, {})
        # Cut down to the sampled tokens, the model returns only their rows, in order.
        logits = self.model.compute_logits(  # type: ignore[operator]
            hidden if reduced else hidden[sample_t])
        tokens, logprobs = self.sampler.sample(logits, sample_ids,
                                               [params[r] for r in sample_ids])
        return RunnerOutput(
            sampled=dict(zip(sample_ids, tokens, strict=True)),
            logprobs={r: lp for r, lp in zip(sample_ids, logprobs, strict=True) if lp},
            logits=({r: logits[i].float().cpu() for i, r in enumerate(sample_ids)}
                    if self.keep_logits else {}))
