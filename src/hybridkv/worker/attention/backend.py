"""Attention over the paged KV cache: per-group metadata and a small backend registry.

The torch reference backend runs anywhere torch runs (CPU is the tested path): it writes K/V
through the slot mapping, then attends request by request over the request's blocks with
causal, sliding-window and chunked masks, GQA, logit soft-capping and attention sinks.

K-only pages (`AttentionParams.derive_kv`; Gemma 4's values-equal-keys layers) hold one
tensor per token, the raw key projection, instead of K and V:

    K/V pages     [pages, blocks_per_page, 2, block, Hk, D]   K and V as the layer wrote them
    K-only pages  [pages, blocks_per_page, block, Hk, D]      raw keys; at each read the
                  layer's `derive_kv(raw [P, L, Hk, D], positions [L])` -> (K, V)

A context's positions are 0..L-1 (block order is position order), so RoPE of the derived keys
is exact; everything after the gather (plans, padding, masks) is the same for both layouts.

Quantized pages (`AttentionMetadata.cache_dtype`, kv/spec.py) hold rows of bytes instead of
head_size values: K/V are quantized as they are written (worker/attention/kv_quant.py) and
the rows a batch gathers are dequantized into the compute dtype before SDPA.

q4 K/V pages (`AttentionMetadata.key_groups`) quantize keys per channel over groups of
KEY_GROUP tokens. A group is quantized when its last token is written; until then its keys
wait in full precision in the layer's staging buffer (one group per running request, kept by
the runner). A query at position p reads the keys before its own group's start from the pages
and its own group's keys (up to p) in full precision: the same keys whether the prompt came
in one chunk or many, from a prefix hit or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from torch import nn

from hybridkv.kv.spec import KEY_GROUP, q4_kv_layout
from hybridkv.worker.attention.kv_quant import (
    dequantize_key_groups,
    dequantize_rows,
    dequantize_values_q4,
    quantize_key_groups,
    quantize_queries,
    quantize_rows,
    quantize_values_q4,
    quantizes_queries,
    write_v_q4,
)
from hybridkv.worker.attention.scored import attend_scored
from hybridkv.worker.linear import cpu as cpu_linear


@dataclass
class PaddedBatch:
    """Requests attended in one call: queries padded to the batch's longest chunk, contexts
    to its longest context (masked). A padding query slot repeats its request's last query
    (a real position, so no row is all masked); its output is dropped.

        tokens [P, Qm]  flat token index of each query slot
        valid  [P, Qm]  real slots
        q_pos  [P, Qm]  positions of the queries
        key_start [P, 1]  position of each row's first gathered key; None: 0 for all. With
                          a window or chunk, only the kernel blocks some query can see
                          are gathered (a decode step of a sliding layer reads the window,
                          not the whole context)
    """

    tokens: torch.Tensor
    valid: torch.Tensor
    q_pos: torch.Tensor
    gather: tuple[torch.Tensor, ...]  # [P, n] index into the KV view (see `_gather_padded`)
    all_valid: bool  # no padding slot: outputs go straight back by `tokens`
    # Every row is a whole prompt so far (its chunk starts at position 0): without padding,
    # the mask is plain causal, which SDPA can skip instead of reading (about 2x faster).
    from_start: bool = False
    max_seq_len: int = 0
    key_start: torch.Tensor | None = None
    rows: tuple[int, ...] = ()  # the requests, as indices into the metadata's lists
    _masks: dict[tuple[int | None, int | None], torch.Tensor] = field(default_factory=dict)

    @property
    def num_kv(self) -> int:
        return int(self.gather[-1].shape[1])

    def mask(self, window: int | None, chunk: int | None, kernel_block_size: int
             ) -> torch.Tensor:
        """[P, Qm, L]: which cached positions each query may attend to (shared by the
        group's layers with the same window and chunk)."""
        mask = self._masks.get((window, chunk))
        if mask is None:
            num_pos = self.num_kv * kernel_block_size
            k_pos = torch.arange(num_pos, device=self.q_pos.device)[None, None, :]
            if self.key_start is not None:
                k_pos = k_pos + self.key_start[:, :, None]
            q_pos = self.q_pos[:, :, None]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= q_pos - k_pos < window
            if chunk is not None:
                mask &= k_pos // chunk == q_pos // chunk
            self._masks[(window, chunk)] = mask
        return mask


@dataclass
class FreshKeys:
    """One layer's full-precision keys of this step's key groups: per request, positions
    starts[r] (its first group's start) up to its context's end, [R, F, Hk, D] padded."""

    keys: torch.Tensor
    starts: list[int]


@dataclass
class KeyGroupPlan:
    """The index work of q4 K/V writes, shared by every layer of the group in a step.

        from_k   [T]      the flat fresh position [R * F] of each of this step's keys
        from_stage        (fresh positions, staged rows [rows * KEY_GROUP]) of the keys
                          staged before this step (padding positions take neither: never
                          read)
        complete [N, G]   the finished groups' positions as flat indices into the fresh keys
        where    (pages, slots, offsets), each [N, G]: where their rows go
        stage    [R, G]   each request's last group, flat fresh indices (clamped)
    """

    from_k: torch.Tensor
    from_stage: tuple[torch.Tensor, torch.Tensor]
    width: int
    starts: list[int]
    complete: torch.Tensor
    where: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    stage: torch.Tensor
    stage_rows: torch.Tensor

    @staticmethod
    def build(meta: AttentionMetadata) -> KeyGroupPlan:
        assert meta.stage_rows is not None, "q4 K/V pages need the requests' staging rows"
        g = KEY_GROUP
        device = meta.slot_mapping.device

        def index(x: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        firsts = [s - n for s, n in zip(meta.seq_lens, meta.query_lens, strict=True)]
        starts = [p0 - p0 % g for p0 in firsts]
        width = max((s - start for s, start in zip(meta.seq_lens, starts, strict=True)),
                    default=1)
        k_dst: list[int] = []
        stage_dst: list[int] = []
        stage_src: list[int] = []
        complete: list[list[int]] = []
        first_tok: list[int] = []
        back: list[int] = []
        stage: list[list[int]] = []
        for r, (s, p0, start) in enumerate(zip(meta.seq_lens, firsts, starts, strict=True)):
            qs, row, base = meta.query_start_loc[r], meta.stage_rows[r], r * width
            # Keys before this step's first token are staged; the rest are this step's,
            # in flat token order (so their fresh positions are one run).
            stage_dst += range(base, base + p0 - start)
            stage_src += range(row * g, row * g + p0 - start)
            k_dst += range(base + p0 - start, base + s - start)
            for gs in range(start, s - g + 1, g):  # groups whose last token is in
                complete.append(list(range(base + gs - start, base + gs - start + g)))
                pn = max(gs, p0)  # the group's first token written this step
                first_tok.append(qs + pn - p0)
                back.append(pn - gs)
            last = (s - 1) - (s - 1) % g
            stage.append([base + min(pos, s - 1) - start for pos in range(last, last + g)])
        if complete:
            # A group lies inside one kernel block: its slots run on from its first one.
            first = meta.slot_mapping[index(first_tok)] - index(back)
            slots = first[:, None] + torch.arange(g, device=device)
            blocks, offsets = slots // meta.block_size, slots % meta.block_size
            where = (blocks // meta.blocks_per_page, blocks % meta.blocks_per_page, offsets)
        else:
            empty = torch.zeros(0, g, dtype=torch.int64, device=device)
            where = (empty, empty, empty)
        return KeyGroupPlan(
            from_k=index(k_dst), from_stage=(index(stage_dst), index(stage_src)),
            width=width, starts=starts, complete=index(complete).view(-1, g), where=where,
            stage=index(stage), stage_rows=index(meta.stage_rows))


@dataclass
class AttentionMetadata:
    """One group's view of the batch; every group lists requests in the same order."""

    query_start_loc: list[int]  # [num_reqs + 1] offsets of each request's tokens
    seq_lens: list[int]  # per request: context length once this step's tokens are in
    block_table: torch.Tensor  # [num_reqs, max_kernel_blocks] kernel block ids
    slot_mapping: torch.Tensor  # [num_tokens] kernel_block_id * kernel_block_size + offset
    block_size: int  # the manager's block size (tokens per block of the KV view)
    kernel_block_size: int
    blocks_per_page: int  # of the group's KV views: block b is (page b // n, slot b % n)
    cache_dtype: str | None = None  # quantized pages (kv/spec.py CACHE_DTYPES), else None
    # Per request: its prompt's length (a lightning indexer's top-k breaks ties as the
    # reference does over rows of that length: worker/attention/sparse_mla.py); None: not given.
    prompt_lens: list[int] | None = None
    # q4 K/V pages with keys per channel over KEY_GROUP tokens (see the module docstring):
    # per layer (its KV view's data_ptr) the staging buffer [rows, KEY_GROUP, Hk, D] of the
    # requests' unfinished groups, each request's row in it, and the step's full-precision
    # keys of every request's groups it writes (filled by the writes, read by the reads; a
    # cut-down copy of this metadata shares it).
    key_groups: bool = False
    staging: dict[int, torch.Tensor] | None = None
    stage_rows: list[int] | None = None
    fresh: dict[int, FreshKeys] = field(default_factory=dict)
    # Views that KV-sharing layers read after their writer: their fresh keys stay for the
    # step; every other layer's are dropped once it has attended (ForwardContext.attention).
    shared_views: frozenset[int] = frozenset()
    # Per (window, chunk): the batches to attend in one call each, and the requests whose
    # chunk is longer than the window/chunk (attended alone, in query blocks).
    _plans: dict[tuple[int | None, int | None],
                 tuple[list[PaddedBatch], list[int]]] = field(default_factory=dict)
    # (rows, first visible kernel block per row or None) -> batch
    _batches: dict[tuple[tuple[int, ...], tuple[int, ...] | None], PaddedBatch] = field(
        default_factory=dict)
    _short_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    # Everything below depends only on the batch, not on the layer: computed once per step
    # by the first layer that asks, reused by the others.
    @cached_property
    def write_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page, slot, offset) where each scheduled token's K/V goes."""
        blocks = self.slot_mapping // self.block_size
        offsets = self.slot_mapping % self.block_size
        return blocks // self.blocks_per_page, blocks % self.blocks_per_page, offsets

    @cached_property
    def query_lens(self) -> list[int]:
        loc = self.query_start_loc
        return [loc[r + 1] - loc[r] for r in range(len(self.seq_lens))]

    @cached_property
    def host_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """query_start_loc and seq_lens as int64 CPU tensors (for kernels given pointers)."""
        return (torch.tensor(self.query_start_loc, dtype=torch.int64),
                torch.tensor(self.seq_lens, dtype=torch.int64))

    @cached_property
    def key_group_plan(self) -> KeyGroupPlan:
        """Where each request's fresh keys come from and where its finished groups go."""
        return KeyGroupPlan.build(self)

    def block_index(self, kernel_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Kernel block ids [P, n] as `_gather_padded` takes them: the ids (manager block
        ids), or (page, slot, kernel block) when kernel blocks split manager blocks."""
        k_per_block = self.block_size // self.kernel_block_size
        if k_per_block == 1:
            return (kernel_ids,)
        blocks = kernel_ids // k_per_block
        return (blocks // self.blocks_per_page, blocks % self.blocks_per_page,
                kernel_ids % k_per_block)

    def short_rows(self, max_query: int) -> torch.Tensor:
        """The requests with at most `max_query` queries this step, int64 CPU tensor."""
        rows = self._short_rows.get(max_query)
        if rows is None:
            rows = self._short_rows[max_query] = torch.tensor(
                [r for r, n in enumerate(self.query_lens) if n <= max_query],
                dtype=torch.int64)
        return rows

    def plan(self, window: int | None, chunk: int | None
             ) -> tuple[list[PaddedBatch], list[int]]:
        """(batches, requests attended alone). Single-token requests form one batch; prompt
        chunks are batched by length (a batch's chunks are within 2x of its longest, so
        padding costs at most about as much as the real work); with a window or chunk, a
        chunk longer than it goes alone, in query blocks (O(n * window), not O(n^2))."""
        key = (window, chunk)
        if key not in self._plans:
            local = min((x for x in (window, chunk) if x is not None), default=None)
            lens = self.query_lens
            decode = [r for r, n in enumerate(lens) if n == 1]
            alone = [r for r, n in enumerate(lens) if n > 1 and local is not None
                     and n > local]
            chunks = sorted((r for r, n in enumerate(lens) if n > 1 and r not in alone),
                            key=lambda r: (-lens[r], -self.seq_lens[r]))
            groups = [decode] if decode else []
            for r in chunks:
                head = groups[-1][0] if groups and groups[-1] is not decode else None
                if head is None or 2 * lens[r] < lens[head] or \
                        2 * self.seq_lens[r] < self.seq_lens[head]:
                    groups.append([r])
                else:
                    groups[-1].append(r)
            self._plans[key] = ([self._batch(tuple(g), window, chunk) for g in groups],
                                alone)
        return self._plans[key]

    def _batch(self, rows: tuple[int, ...], window: int | None, chunk: int | None
               ) -> PaddedBatch:
        first = self._first_kernel_blocks(rows, window, chunk)
        key = (rows, first)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = self._make_batch(rows, first)
        return batch

    def whole_context_batch(self, batch: PaddedBatch) -> PaddedBatch:
        """The same requests with every context read from position 0."""
        return self._batch(batch.rows, None, None)

    def _first_kernel_blocks(self, rows: tuple[int, ...], window: int | None,
                             chunk: int | None) -> tuple[int, ...] | None:
        """Per row, the first kernel block any of its queries can see; None when that is
        block 0 for every row (full attention, or contexts within the window)."""
        if window is None and chunk is None:
            return None
        first = []
        for r in rows:
            first_q = self.seq_lens[r] - self.query_lens[r]
            lo = 0
            if window is not None:
                lo = max(lo, first_q - window + 1)
            if chunk is not None:
                lo = max(lo, first_q // chunk * chunk)
            first.append(lo // self.kernel_block_size)
        return tuple(first) if any(first) else None

    def _make_batch(self, rows: tuple[int, ...], first: tuple[int, ...] | None
                    ) -> PaddedBatch:
        device = self.slot_mapping.device
        lens = [self.query_lens[r] for r in rows]
        max_q = max(lens)
        q_len = torch.tensor(lens, dtype=torch.int64, device=device)[:, None]  # [P, 1]
        start = torch.tensor([self.query_start_loc[r] for r in rows], dtype=torch.int64,
                             device=device)[:, None]
        seq = torch.tensor([self.seq_lens[r] for r in rows], dtype=torch.int64,
                           device=device)[:, None]
        col = torch.arange(max_q, device=device)[None, :]
        slot = torch.minimum(col, q_len - 1)  # padding repeats the last query
        kb = self.kernel_block_size
        table = self.block_table[torch.tensor(rows, device=device)]
        key_start = None
        if first is None:
            kernel_ids = table[:, :-(-max(self.seq_lens[r] for r in rows) // kb)]
        else:
            # Each row from its first visible block; columns past a row's last block
            # repeat the table's last column and are masked (their positions are past the
            # row's context).
            num = max(-(-self.seq_lens[r] // kb) - f for r, f in zip(rows, first, strict=True))
            first_t = torch.tensor(first, dtype=torch.int64, device=device)[:, None]
            cols = (first_t + torch.arange(num, device=device)).clamp(max=table.shape[1] - 1)
            kernel_ids = table.gather(1, cols)
            key_start = first_t * kb
        gather = self.block_index(kernel_ids)
        seq_lens = [self.seq_lens[r] for r in rows]
        return PaddedBatch(tokens=start + slot, valid=col < q_len,
                           q_pos=seq - q_len + slot, gather=gather,
                           all_valid=min(lens) == max_q, from_start=seq_lens == lens,
                           max_seq_len=max(seq_lens), key_start=key_start, rows=rows)


@dataclass(frozen=True)
class AttentionParams:
    """What a layer asks of the backend besides its tensors."""

    scale: float
    sliding_window: int | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_heads] learned sink logits
    # K-only pages: raw keys [..., L, Hk, D] at positions [L] -> (K, V), each [..., L, Hk, D].
    derive_kv: Callable[[torch.Tensor, torch.Tensor],
                        tuple[torch.Tensor, torch.Tensor]] | None = None
    # Scores that depend on the query token (worker/attention/scored.py), given per step:
    # query_bias [T, Hq, E], a bias per query and backward distance 0..E-1 (zero beyond);
    # token_sinks [T, Hq], a sink logit per query. Either takes the layer off the batched
    # paths: request by request here, in place in the "cpu" backend's scored kernel.
    query_bias: torch.Tensor | None = None
    token_sinks: torch.Tensor | None = None

    @property
    def scores_per_query(self) -> bool:
        return self.query_bias is not None or self.token_sinks is not None


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                params: AttentionParams) -> torch.Tensor:
        """Write k/v (None for a layer that reads another layer's cache), then attend."""

    def write(self, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
              meta: AttentionMetadata, params: AttentionParams) -> None:
        """Only the write half of `forward`."""


class TorchReferenceBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                params: AttentionParams) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] or None (KV sharing: the cache is already written);
        kv_cache [pages, blocks_per_page, 2, block, Hk, D]. Returns [T, Hq, D]. With
        `params.derive_kv`: k holds raw keys, v is None, kv_cache is K-only (no `2` dim).

        One call per batch of the plan (all single-token requests together, prompt chunks
        of similar lengths together); only a chunk longer than its window goes alone."""
        self.write(k, v, kv_cache, meta, params)
        return self.attend(q, kv_cache, meta, params)

    def write(self, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
              meta: AttentionMetadata, params: AttentionParams) -> None:
        """This step's K and V (raw keys on K-only pages) into their slots."""
        keys_only = params.derive_kv is not None
        if keys_only != (kv_cache.dim() == 5):
            raise ValueError(
                "the layer derives K and V from raw keys but its pages hold K and V"
                if keys_only else "K-only pages need a layer that derives K and V from them "
                "(AttentionParams.derive_kv)")
        if k is not None and keys_only:
            pages, slots, offsets = meta.write_index
            kv_cache[pages, slots, offsets] = to_page(k, kv_cache, meta)
        elif k is not None and v is not None and meta.key_groups:
            write_key_groups(k, v, kv_cache, meta)
        elif k is not None and v is not None:
            self._write(k, v, kv_cache, meta)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               params: AttentionParams) -> torch.Tensor:
        """Every request's queries over its context."""
        if params.derive_kv is None and quantizes_queries(meta.cache_dtype, q.shape[-1]):
            q = quantize_queries(q, params.scale)  # as the CPU kernel reads int8 pages
        if params.scores_per_query:
            return self._attend_scored(q, kv_cache, meta, params)
        if meta.key_groups and params.derive_kv is None:
            out = torch.empty_like(q)
            for r, n in enumerate(meta.query_lens):
                start = meta.query_start_loc[r]
                out[start:start + n] = attend_key_groups(q[start:start + n], kv_cache,
                                                         meta, r, params)
            return out
        batches, alone = meta.plan(params.sliding_window, params.chunk_size)
        if len(batches) == 1 and not alone and batches[0].all_valid and \
                batches[0].tokens.numel() == q.shape[0]:
            # One batch holding every token (a decode step; equal prompt chunks): rows
            # are already in flat order, nothing to scatter back.
            batch = batches[0]
            return self._attend_batch(q.view(*batch.tokens.shape, *q.shape[1:]), kv_cache,
                                      meta, batch, params).flatten(0, 1)
        out = torch.empty_like(q)
        for batch in batches:
            res = self._attend_batch(q[batch.tokens], kv_cache, meta, batch, params)
            if batch.all_valid:
                out[batch.tokens.flatten()] = res.flatten(0, 1)
            else:
                out[batch.tokens[batch.valid]] = res[batch.valid]
        for r in alone:
            start, end = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            keys, values = self._gather(kv_cache, meta, r, params, q)
            out[start:end] = _attend(q[start:end], keys, values, meta.seq_lens[r], params)
        return out

    def _attend_scored(self, q: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
        """A per-query bias or sink: each request alone over its gathered context."""
        if meta.key_groups or params.derive_kv is not None:
            raise NotImplementedError("a per-query relative bias or sink on q4 K/V or "
                                      "K-only pages")
        out = torch.empty_like(q)
        for r, n in enumerate(meta.query_lens):
            if n == 0:
                continue
            start = meta.query_start_loc[r]
            keys, values = self._gather(kv_cache, meta, r, params, q)
            rows = slice(start, start + n)
            out[rows] = attend_scored(
                q[rows], keys, values, meta.seq_lens[r], params,
                None if params.query_bias is None else params.query_bias[rows],
                None if params.token_sinks is None else params.token_sinks[rows])
        return out

    @staticmethod
    def _attend_batch(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      batch: PaddedBatch, params: AttentionParams) -> torch.Tensor:
        """q [P, Qm, Hq, D] -> [P, Qm, Hq, D] over each request's cached context."""
        local = min((x for x in (params.sliding_window, params.chunk_size) if x is not None),
                    default=None)
        if batch.all_valid and batch.from_start and params.softcap is None and \
                params.sinks is None and (local is None or batch.max_seq_len <= local):
            # Prompts from position 0 that no window or chunk cuts: causal alone decides.
            num_q = q.shape[1]
            keys, values = _context_kv(kv_cache, meta, batch.gather, params, num_q,
                                       like=q)
            return _attend_padded(q, keys, values, None, params)
        if batch.key_start is not None and params.derive_kv is not None:
            # K-only pages derive RoPE for positions 0..L-1: read the whole contexts.
            batch = meta.whole_context_batch(batch)
        keys, values = _context_kv(kv_cache, meta, batch.gather, params,
                                   like=q)  # [P, L, Hk, D]
        if _takes_c_tiles(q, keys, params):
            # Each row's queries over exactly the keys they see, no mask read.
            key_starts = [0] * len(batch.rows) if batch.key_start is None else \
                batch.key_start[:, 0].tolist()
            return _c_tiles(q, keys, values, params,
                            [meta.seq_lens[r] - meta.query_lens[r] for r in batch.rows],
                            key_starts, [meta.query_lens[r] for r in batch.rows])
        allowed = batch.mask(params.sliding_window, params.chunk_size,
                             meta.kernel_block_size)  # [P, Qm, L]
        return _attend_padded(q, keys, values, allowed, params)

    @staticmethod
    def _write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> None:
        # Kernel slots and manager slots are the same numbers (see BlockTable).
        pages, slots, offsets = meta.write_index
        kv_cache[pages, slots, 0, offsets] = to_page(k, kv_cache, meta)
        kv_cache[pages, slots, 1, offsets] = to_page(v, kv_cache, meta)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, meta: AttentionMetadata, r: int,
                params: AttentionParams, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's keys and values, [seq_len, Hk, D] each."""
        kb = meta.kernel_block_size
        seq_len = meta.seq_lens[r]
        index = meta.block_index(meta.block_table[r:r + 1, :-(-seq_len // kb)])
        keys, values = _context_kv(kv_cache, meta, index, params, seq_len, like=like)
        return keys[0], values[0]


def write_key_groups(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata) -> None:
    """q4 K/V pages: V rows as they come; K groups whose last token is in this step,
    quantized from their full-precision keys (staged ones and this step's); every request's
    last group into its staging row; the step's fresh keys kept for the reads."""
    lay = q4_kv_layout(k.shape[-1])
    if not write_v_q4(v, kv_cache, meta.slot_mapping, meta.block_size, meta.blocks_per_page):
        # (Index a narrowed view: torch 2.13 ignores a slice after an integer among tensor
        # indices, kv_cache[p, s, 1, o, :n].)
        pages, slots, offsets = meta.write_index
        kv_cache.narrow(-1, 0, lay.v_bytes)[pages, slots, 1, offsets] = quantize_values_q4(v)
    assert meta.staging is not None
    staging = meta.staging[kv_cache.data_ptr()]
    plan = meta.key_group_plan
    flat = staging.new_empty(len(plan.starts) * plan.width, *staging.shape[2:])
    flat[plan.from_k] = k.to(staging.dtype)
    if plan.from_stage[0].numel():
        flat[plan.from_stage[0]] = staging.flatten(0, 1)[plan.from_stage[1]]
    fresh = flat.view(len(plan.starts), plan.width, *staging.shape[2:])  # [R, F, Hk, D]
    if plan.complete.numel():
        k_rows, v_tails = quantize_key_groups(flat[plan.complete])
        pages, slots, offsets = plan.where
        kv_cache[pages, slots, 0, offsets] = k_rows
        kv_cache.narrow(-1, lay.v_bytes, lay.v_tail)[pages, slots, 1, offsets] = v_tails
    staging[plan.stage_rows] = flat[plan.stage]
    meta.fresh[kv_cache.data_ptr()] = FreshKeys(fresh, plan.starts)


def attend_key_groups(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      r: int, params: AttentionParams) -> torch.Tensor:
    """Request r's queries [nq, Hq, D] over q4 K/V pages: keys before each query's own
    group from the pages, its own group's from the step's fresh keys. Queries go in blocks
    of the window or chunk (O(nq * window) with one), or all at once."""
    seq_len, num_q = meta.seq_lens[r], q.shape[0]
    fresh = meta.fresh[kv_cache.data_ptr()]
    fresh_start = fresh.starts[r]
    g = KEY_GROUP
    local = params.sliding_window or params.chunk_size or num_q
    out = torch.empty_like(q)
    first = seq_len - num_q
    a = first
    while a < seq_len:
        b = min(a + local, seq_len)
        if params.chunk_size is not None:
            b = min(b, (a // params.chunk_size + 1) * params.chunk_size)
        lo = 0
        if params.sliding_window is not None:
            lo = max(lo, a - params.sliding_window + 1)
        if params.chunk_size is not None:
            lo = max(lo, a // params.chunk_size * params.chunk_size)
        lo -= lo % g
        own = a - a % g  # the first query's group: fresh keys from here
        paged_end = (b - 1) - (b - 1) % g  # the last query's group: paged keys up to it
        k_rows, v_rows = _request_rows(kv_cache, meta, r, lo, b)
        values = dequantize_values_q4(v_rows, q.shape[-1], q.dtype)  # [b - lo, Hk, D]
        paged = dequantize_key_groups(k_rows[:paged_end - lo], v_rows[:paged_end - lo],
                                      q.shape[-1], q.dtype)
        own_keys = fresh.keys[r, own - fresh_start:b - fresh_start].to(q.dtype)
        keys = torch.cat([paged, own_keys])
        vals = torch.cat([values[:paged_end - lo], values[own - lo:]])
        q_pos = torch.arange(a, b, device=q.device)[:, None]
        k_pos = torch.cat([torch.arange(lo, paged_end, device=q.device),
                           torch.arange(own, b, device=q.device)])[None, :]
        q_group = q_pos - q_pos % g
        from_pages = torch.arange(keys.shape[0], device=q.device)[None, :] < paged_end - lo
        allowed = (k_pos <= q_pos) & torch.where(from_pages, k_pos < q_group,
                                                  k_pos >= q_group)
        if params.sliding_window is not None:
            allowed &= q_pos - k_pos < params.sliding_window
        if params.chunk_size is not None:
            allowed &= k_pos // params.chunk_size == q_pos // params.chunk_size
        out[a - first:b - first] = _attend_padded(
            q[a - first:b - first][None], keys[None], vals[None], allowed[None], params)[0]
        a = b
    return out


def _request_rows(kv_cache: torch.Tensor, meta: AttentionMetadata, r: int, lo: int,
                  end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request r's K rows and V rows of positions lo..end-1, [end - lo, Hk, row] each."""
    kb = meta.kernel_block_size
    index = meta.block_index(meta.block_table[r:r + 1, lo // kb:-(-end // kb)])
    keys, values = _gather_padded(kv_cache, meta, index)
    skip = lo - lo // kb * kb
    return keys[0, skip:skip + end - lo], values[0, skip:skip + end - lo]


def to_page(x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Rows as the pages store them: quantized, or in the pages' dtype."""
    if meta.cache_dtype is None:
        return x.to(kv_cache.dtype)
    return quantize_rows(x, meta.cache_dtype)


def from_page(rows: torch.Tensor, meta: AttentionMetadata, head_size: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Rows read from pages as `head_size` values of `dtype` (quantized pages), or as they
    are (pages in the model's dtype)."""
    if meta.cache_dtype is None:
        return rows
    return dequantize_rows(rows, meta.cache_dtype, head_size, dtype)


def _context_kv(kv_cache: torch.Tensor, meta: AttentionMetadata,
                index: tuple[torch.Tensor, ...], params: AttentionParams,
                length: int | None = None, *, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in `index` (see `_gather_padded`), their first
    `length` positions (None: all), [P, L, Hk, D] each: read from K/V pages, or derived by
    the layer from K-only pages' raw keys at positions 0..L-1. Quantized rows come back
    as values of `like`'s (the queries') head size and dtype."""
    if params.derive_kv is None:
        keys, values = _gather_padded(kv_cache, meta, index)
        return (from_page(keys[:, :length], meta, like.shape[-1], like.dtype),
                from_page(values[:, :length], meta, like.shape[-1], like.dtype))
    raw = from_page(_gather_raw_keys(kv_cache, meta, index)[:, :length], meta,
                    like.shape[-1], like.dtype)
    return params.derive_kv(raw, torch.arange(raw.shape[1], device=raw.device))


def _gather_raw_keys(kv_cache: torch.Tensor, meta: AttentionMetadata,
                     index: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The raw keys of the blocks in `index` from K-only pages [pages, per_page, block, Hk,
    D]: [P, n * kernel_block, Hk, D]."""
    flat = _flat_blocks(kv_cache)
    if len(index) == 1 and flat is not None:  # [num_blocks, block, Hk, D]: one row copy
        ids = index[0]
        return flat.index_select(0, ids.flatten()).view(ids.shape[0], -1, *flat.shape[2:])
    if len(index) == 1:  # padded large pages: no flat block view
        blocks = index[0]
        raw = kv_cache[blocks // meta.blocks_per_page, blocks % meta.blocks_per_page]
    else:  # kernel blocks inside manager blocks
        split = kv_cache.unflatten(2, (meta.block_size // meta.kernel_block_size,
                                       meta.kernel_block_size))
        raw = split[index[0], index[1], index[2]]
    return raw.flatten(1, 2)  # [P, n, block, Hk, D] -> [P, L, Hk, D]


def _gather_padded(kv_cache: torch.Tensor, meta: AttentionMetadata,
                   index: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in `index` ([P, n] block ids, or (page, slot, kernel
    block) when kernel blocks split manager blocks), each [P, n * kernel_block, Hk, D]."""
    flat = _flat_blocks(kv_cache)
    if len(index) == 1 and flat is not None:
        # A block's K (or V) is one contiguous row: gathering rows is a plain row copy,
        # much faster than gathering a strided 4-D view.
        ids = index[0].flatten()
        shape = (*index[0].shape[:1], -1, *flat.shape[3:])
        rows, per_block = _page_rows(flat)
        if rows is not None:
            # One index_select from an evenly strided source (2.4x faster than from the
            # K or V half of each block as a strided view): all K rows, then all V rows.
            ids = ids * per_block
            kv = rows.index_select(0, torch.cat([ids, ids + 1]))
            keys, values = kv.view(2, *shape)
            return keys, values
        halves = flat.flatten(2)  # [num_blocks, 2, block * Hk * D]
        keys = halves[:, 0].index_select(0, ids).view(shape)
        values = halves[:, 1].index_select(0, ids).view(shape)
        return keys, values
    if len(index) == 1:  # padded large pages: no flat block view
        blocks = index[0]
        pages, slots = blocks // meta.blocks_per_page, blocks % meta.blocks_per_page
        keys, values = kv_cache[pages, slots, 0], kv_cache[pages, slots, 1]
    else:  # kernel blocks inside manager blocks
        split = kv_cache.unflatten(3, (meta.block_size // meta.kernel_block_size,
                                       meta.kernel_block_size))
        keys = split[index[0], index[1], 0, index[2]]
        values = split[index[0], index[1], 1, index[2]]
    return keys.flatten(1, 2), values.flatten(1, 2)  # [P, L, Hk, D]


def _attend_padded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   allowed: torch.Tensor | None, params: AttentionParams) -> torch.Tensor:
    """q [P, Qm, Hq, D] over keys/values [P, L, Hk, D] where `allowed` [P, Qm, L]; None:
    causal, the queries and keys both at positions 0.. (then without soft-cap or sinks)."""
    num_reqs, num_q, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    if allowed is None and keys.shape[1] == num_q and _takes_c_tiles(q, keys, params):
        return _c_tiles(q, keys, values, params, [0] * num_reqs)
    if allowed is None and params.softcap is None and params.sinks is None and \
            num_q >= 2 * CAUSAL_TILE and q.device.type == "cpu" and \
            q.dtype == torch.float32 and keys.shape[1] == num_q:
        return _causal_tiles(q, keys, values, params.scale)
    if params.softcap is None and params.sinks is None:
        # Plain softmax attention: torch's fused kernel (on CPU and CUDA alike); 4-D
        # inputs, or the CPU build takes its slow math path.
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=None if allowed is None else allowed[:, None], scale=params.scale,
            is_causal=allowed is None, enable_gqa=group > 1)  # [P, Hq, Qm, D]
        return out.transpose(1, 2)
    assert allowed is not None
    # Query heads grouped by the KV head they share: [P, Qm, Hk, G, D]
    qg = q.float().view(num_reqs, num_q, num_kv_heads, group, head_dim)
    scores = torch.einsum("pqkgd,plkd->pkgql", qg, keys.float()) * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if params.sinks is not None:
        # A per-head sink logit joins the softmax and takes probability mass, no value.
        sink = params.sinks.float().view(1, num_kv_heads, group, 1, 1).expand(
            num_reqs, -1, -1, num_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("pkgql,plkd->pqkgd", probs, values.float())
    return out.reshape(num_reqs, num_q, num_heads, head_dim).to(q.dtype)


# Query positions per tile of a long causal prompt in torch (see _causal_tiles).
CAUSAL_TILE = 64
# Queries from which a request's attention runs on linear.c's kernel (see _c_tiles): below,
# packing its keys costs more than the scores it spares.
C_TILES_MIN_QUERIES = 16


def _takes_c_tiles(q: torch.Tensor, keys: torch.Tensor, params: AttentionParams) -> bool:
    """Whether `_c_tiles` runs q [P, Qm, Hq, D] over keys [P, L, Hk, D]: float32 on the CPU,
    plain softmax (no soft-cap, no sinks), enough queries, the kernel built."""
    return (q.shape[1] >= C_TILES_MIN_QUERIES and params.softcap is None
            and params.sinks is None and q.device.type == "cpu" and q.dtype == torch.float32
            and keys.dtype == torch.float32 and cpu_linear.attention_kernel() is not None)


def _c_tiles(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             params: AttentionParams, q_starts: list[int], key_starts: list[int] | None = None,
             counts: list[int] | None = None) -> torch.Tensor:
    """q [P, Qm, Hq, D] over keys/values [P, L, Hk, D] on linear.c's kernel, one call per
    request and KV head: request p's first counts[p] queries (all: None) at positions
    q_starts[p].., its keys at key_starts[p].. (0: None), each query over the keys at its
    position and before, from its window's or chunk's start. Rows past a request's count
    (padding) are left unwritten.

    K and V are packed once into the kernel's panels, each tile of six query rows scored
    over only the keys its rows see, softmaxed in place and weighted over exactly those: at
    the core's GEMM rate. Gemma 3's 512-token causal layer (4 query heads over 1 KV head of
    256) 7.1 -> 6.3 ms against query tiles of 64 positions with two products each on the
    panels and torch's softmax; torch's flash kernel ran it at ~43 GFLOP/s of the causal
    half, and a window through a mask computes the whole square."""
    num_reqs, num_q, num_heads, head_dim = q.shape
    num_kv_heads, value_dim = keys.shape[2], values.shape[-1]
    group = num_heads // num_kv_heads
    out = torch.empty((num_reqs, num_q, num_heads, value_dim), dtype=q.dtype)
    for p in range(num_reqs):
        n = num_q if counts is None else counts[p]
        k_start = 0 if key_starts is None else key_starts[p]
        seen = q_starts[p] + n - k_start  # keys up to the last query's position
        for h in range(num_kv_heads):
            heads = slice(h * group, (h + 1) * group)
            # [n * G, D] rows (position-major), the scale folded in once.
            q_rows = (q[p, :n, heads] * params.scale).reshape(n * group, head_dim)
            k_panels, _ = cpu_linear.pack(keys[p, :seen, h], None)  # [seen/64, D, 64]
            v_panels = _value_panels(values[p, :seen, h])  # [Dv/64, seen, 64]
            o_rows = out[p, :n].view(n * group, value_dim) if group == num_heads else \
                torch.empty((n * group, value_dim), dtype=q.dtype)
            cpu_linear.attention(q_rows, group, k_panels, seen, v_panels, o_rows,
                                 q_start=q_starts[p], k_start=k_start,
                                 window=params.sliding_window, chunk=params.chunk_size)
            if group != num_heads:
                out[p, :n, heads] = o_rows.view(n, group, value_dim)
    return out


def _causal_tiles(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
                  ) -> torch.Tensor:
    """Causal attention of q [P, L, Hq, D] over keys/values [P, L, Hk, D] (positions 0..L-1
    on both sides), float32 on the CPU where linear.c's kernel does not build (see
    `_c_tiles`): queries in tiles of CAUSAL_TILE positions, each over only the keys up to
    its last position, the query heads of one KV head stacked into one matrix product
    (torch's CPU flash kernel ran Gemma 3's 512-token prompt at ~43 GFLOP/s of the causal
    half; two products a tile skip ~44% of the square at 512 tokens)."""
    num_reqs, num_q, num_heads, head_dim = q.shape
    num_kv_heads, value_dim = keys.shape[2], values.shape[-1]
    group = num_heads // num_kv_heads
    out = torch.empty((num_reqs, num_q, num_heads, value_dim), dtype=q.dtype)
    # Row r of a tile is query position a + r // group; it sees keys up to that position.
    rows = torch.arange(CAUSAL_TILE * group) // group
    after = torch.arange(CAUSAL_TILE)[None, :] > rows[:, None]  # [tile rows, tile keys]
    qg = q.view(num_reqs, num_q, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    k_t = keys.permute(0, 2, 3, 1)  # [P, Hk, D, L]
    v_h = values.permute(0, 2, 1, 3)  # [P, Hk, L, Dv]
    for a in range(0, num_q, CAUSAL_TILE):
        b = min(num_q, a + CAUSAL_TILE)
        n = b - a
        q_tile = qg[:, :, a:b].reshape(num_reqs, num_kv_heads, n * group, head_dim)
        scores = torch.matmul(q_tile, k_t[..., :b]).mul_(scale)  # [P, Hk, n G, b]
        scores[..., a:b].masked_fill_(after[:n * group, :n], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v_h[:, :, :b])  # [P, Hk, n G, Dv]
        out[:, a:b] = o.view(num_reqs, num_kv_heads, n, group, value_dim).permute(
            0, 2, 1, 3, 4).reshape(num_reqs, n, num_heads, value_dim)
    return out


def _value_panels(values: torch.Tensor) -> torch.Tensor:
    """values [L, Dv] as the linear kernel's panels of V^T, [ceil(Dv / 64), L, 64]: a
    strided copy where Dv is whole panels (`pack` transposes, ~2x the time here)."""
    length, width = values.shape
    if width % cpu_linear.PANEL:
        return cpu_linear.pack(values.t(), None)[0]
    return values.reshape(length, -1, cpu_linear.PANEL).permute(1, 0, 2).contiguous()


def _page_rows(flat: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """The blocks of a [num_blocks, 2, block, Hk, D] view as rows of one K (or V) page each,
    [rows, block * Hk * D], where block b's K is row b * per_block and its V the next one;
    (None, 0) when the group's block is not a whole number of such pages (layers of other
    sizes share it)."""
    page = flat[0, 0].numel()
    if flat.stride(0) % page or flat.stride(1) != page:
        return None, 0
    per_block = flat.stride(0) // page
    num_rows = (flat.shape[0] - 1) * per_block + 2
    return flat.as_strided((num_rows, page), (page, 1)), per_block


def _flat_blocks(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """[num_blocks, 2, block, H, D] (K-only: [num_blocks, block, H, D]) view of [pages,
    per_page, ...] when the large pages have no padding for this group (then blocks are
    evenly spaced), else None."""
    if not kv_cache[0, 0].is_contiguous():  # a block's K and V must be plain rows
        return None
    if kv_cache.shape[1] == 1:  # one block per page (a size-1 dim's stride is arbitrary)
        return kv_cache[:, 0]
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        return None
    return kv_cache.flatten(0, 1)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int,
            params: AttentionParams) -> torch.Tensor:
    """q [nq, Hq, D] are the last nq positions of a sequence of seq_len; keys/values
    [seq_len, Hk, D]. On linear.c's kernel (`_c_tiles`) each query over only the keys it
    sees; elsewhere, with a window or chunk, queries go in blocks of that size, each over
    only the keys it can see: a long prompt costs O(nq * window), not O(nq * seq_len)."""
    num_q = q.shape[0]
    first = seq_len - num_q
    if _takes_c_tiles(q[None], keys[None], params):  # every query over only what it sees
        return _c_tiles(q[None], keys[None], values[None], params, [first])[0]
    local = params.sliding_window or params.chunk_size
    if local is None or num_q <= local:
        return _attend_block(q, keys, values, first, 0, params)
    out = torch.empty_like(q)
    start = first
    while start < seq_len:
        end = min(start + local, seq_len)
        k_start = 0
        if params.sliding_window is not None:
            k_start = max(k_start, start - params.sliding_window + 1)
        if params.chunk_size is not None:
            end = min(end, (start // params.chunk_size + 1) * params.chunk_size)
            k_start = max(k_start, start // params.chunk_size * params.chunk_size)
        out[start - first:end - first] = _attend_block(
            q[start - first:end - first], keys[k_start:end], values[k_start:end], start,
            k_start, params)
        start = end
    return out


def _attend_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int,
                  k_start: int, params: AttentionParams) -> torch.Tensor:
    """Queries at positions q_start.. over keys at positions k_start.. (the keys end where
    the queries end)."""
    num_q, num_heads = q.shape[0], q.shape[1]
    group = num_heads // keys.shape[1]
    q_pos = torch.arange(q_start, q_start + num_q, device=q.device).unsqueeze(1)
    k_pos = torch.arange(k_start, k_start + keys.shape[0], device=q.device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if params.sliding_window is not None:
        allowed &= q_pos - k_pos < params.sliding_window
    if params.chunk_size is not None:
        allowed &= k_pos // params.chunk_size == q_pos // params.chunk_size
    if params.softcap is None and params.sinks is None:
        # 4-D inputs: with 3-D ones the CPU build takes its slow math path.
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=allowed, scale=params.scale, enable_gqa=group > 1)  # [1, Hq, nq, D]
        return out[0].transpose(0, 1)
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if params.sinks is not None:
        # A per-head sink logit joins the softmax and takes probability mass, no value.
        sink = params.sinks.float().view(num_heads, 1, 1).expand(num_heads, num_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, values.float())
    return out.to(q.dtype)


BACKENDS: dict[str, type[TorchReferenceBackend]] = {"torch": TorchReferenceBackend}
BACKEND_NAMES = ("auto", "cpu", "torch")


def get_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """"torch": gather + SDPA, any device; "cpu": decode reads the pages in place (a C
    kernel compiled on first use, worker/attention/cpu.py); "auto": "cpu" on CPU devices
    where the kernel compiles, else "torch"."""
    from hybridkv.worker import native
    from hybridkv.worker.attention import cpu as cpu_attention  # registers "cpu"

    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; available: "
                         f"{', '.join(BACKEND_NAMES)}")
    name = cpu_attention.choose_backend(name, device)
    if name == "cpu" and torch.device(device).type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on CPU devices, not "
                         f"{torch.device(device).type}; use 'auto' or 'torch'")
    try:
        return BACKENDS[name]()
    except native.NativeBuildError as exc:
        raise ValueError(f"attention backend 'cpu' needs its C kernel: {exc}; use 'auto' "
                         f"or 'torch'") from None
