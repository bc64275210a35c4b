"""Specs + a byte budget -> a KV cache config: groups, large pages, capacity figures.

One group per distinct spec (all layers of one kind together, whatever their number). A group's
block holds its layers' pages back to back, so one block is one contiguous byte range:

    arena = [large page 0 (null blocks) | large page 1 | large page 2 | ...]
    a large page of the full group    = [blk | blk | blk | blk | blk ]   (5 blocks of 10 layers)
    a large page of the sliding group = [ blk  |  blk  |  blk  | pad ]   (52-layer blocks)

Groups with different block bytes share the arena through large pages: each large page is a
common multiple of the groups' block bytes (or, where the exact LCM would be too coarse, a
multiple of the largest block with a little padding for the others) and holds one group's
blocks at a time. Memory moves between groups a large page at a time, so no layer is padded
and no block size is inflated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from hybridkv.kv.spec import (
    DEFAULT_CHECKPOINT_TAIL,
    ChunkedLocalAttentionSpec,
    EncoderOnlySpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
    merge_specs,
)

# A large page may be at most 1/MIN_LARGE_PAGES of the budget (unless one block is bigger):
# coarser pages would make memory move between groups in steps that are too large.
MIN_LARGE_PAGES = 256


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table. Block-major, cross-layer layout: block `b` of this group
    is `[layer 0 page | layer 1 page | ...]`, at arena offset `page(b) * large_page_bytes +
    slot(b) * block_bytes`."""

    group_id: int
    spec: KVCacheSpec
    layer_names: tuple[str, ...]
    layer_page_bytes: tuple[int, ...]
    blocks_per_large_page: int
    # KV sharing: (layer, target) for layers that compute no KV and read the cache of
    # `target`, one of this group's layers. They get no pages of their own.
    shared_layers: tuple[tuple[str, str], ...] = ()
    # Each layer's own spec, where layers of one group differ in page shape (e.g. Gemma 4's
    # full layers with a larger head size joining sliding ones under --no-hybrid).
    layer_specs: tuple[KVCacheSpec, ...] = ()

    @property
    def shared_layer_names(self) -> tuple[str, ...]:
        return tuple(layer for layer, _ in self.shared_layers)

    @property
    def block_bytes(self) -> int:
        return sum(self.layer_page_bytes)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def padding_bytes_per_large_page(self, large_page_bytes: int) -> int:
        return large_page_bytes - self.blocks_per_large_page * self.block_bytes


@dataclass(frozen=True)
class KVCacheConfig:
    """The planner's output that the block pool and the model runner consume."""

    groups: tuple[KVCacheGroup, ...]
    large_page_bytes: int
    num_large_pages: int  # including large page 0, reserved for the null blocks

    @property
    def arena_bytes(self) -> int:
        return self.large_page_bytes * self.num_large_pages

    @property
    def hash_block_size(self) -> int:
        """Token granularity of block hashes: every group's block size is a multiple of it."""
        return math.gcd(*(g.block_size for g in self.groups))

    @property
    def hit_alignment(self) -> int:
        """A prefix hit must end on a block boundary of every group."""
        return math.lcm(*(g.block_size for g in self.groups))


@dataclass(frozen=True)
class KVCachePlan:
    config: KVCacheConfig
    memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    hybrid: bool
    padding_bytes: int
    max_concurrency: float
    capacity_tokens: int
    ideal_bytes_per_token: float
    ideal_fraction: float
    warnings: tuple[str, ...] = field(default=())

    def summary(self) -> dict[str, object]:
        """The machine-readable figures (`hybridkv plan --json`)."""
        cfg = self.config
        return {
            "hybrid": self.hybrid,
            "memory_bytes": self.memory_bytes,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": cfg.hit_alignment,
            "arena_bytes": cfg.arena_bytes,
            "large_page_bytes": cfg.large_page_bytes,
            "num_large_pages": cfg.num_large_pages,
            "padding_bytes": self.padding_bytes,
            "capacity_tokens": self.capacity_tokens,
            "ideal_bytes_per_token": self.ideal_bytes_per_token,
            "ideal_fraction": self.ideal_fraction,
            "max_concurrency": self.max_concurrency,
            "groups": [
                {
                    "group_id": g.group_id,
                    "kind": g.spec.kind,
                    "block_size": g.block_size,
                    "num_layers": len(g.layer_names),
                    "num_shared_layers": len(g.shared_layer_names),
                    "block_bytes": g.block_bytes,
                    # What the pages hold: the KV cache dtype (quantized rows include
                    # their scales in bytes_per_token), or a state group's dtypes.
                    "dtype": group_dtype(g),
                    "bytes_per_token": None if g.spec.is_state
                    else g.block_bytes / g.block_size,
                    "blocks_per_large_page": g.blocks_per_large_page,
                    "padding_bytes_per_large_page":
                        g.padding_bytes_per_large_page(cfg.large_page_bytes),
                    "state_bytes_per_request": g.block_bytes if g.spec.is_state
                    else None,
                    "window": getattr(g.spec, "sliding_window", None)
                    or getattr(g.spec, "attention_chunk_size", None),
                    # Tokens per entry (compressed attention, indexer keys) or per
                    # compressor window (compressor states); None: per token.
                    "compress_rate": getattr(g.spec, "compress_rate", None),
                    "layers": list(g.layer_names),
                }
                for g in cfg.groups
            ],
            "warnings": list(self.warnings),
        }


def group_dtype(group: KVCacheGroup) -> str:
    """"int8", "float32", ...; a state group's distinct state dtypes joined by "+"."""
    dtypes = getattr(group.spec, "dtypes", None)
    if dtypes is not None:
        return "+".join(dict.fromkeys(dtypes))
    page_dtype = getattr(group.spec, "page_dtype", None)
    return str(page_dtype) if page_dtype is not None else "-"


def to_full_attention(spec: KVCacheSpec) -> KVCacheSpec:
    """What `--no-hybrid` does to a layer: keep every token, mask the window in the kernel."""
    if isinstance(spec, SlidingWindowSpec):
        # Latent pages stay latent pages (MLA over a window -> MLA over every token).
        full = MLAAttentionSpec if spec.latent else FullAttentionSpec
        return full(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size, dtype=spec.dtype, keys_only=spec.keys_only,
                    sliding_window=spec.sliding_window, cache_dtype=spec.cache_dtype)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return FullAttentionSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                 head_size=spec.head_size, dtype=spec.dtype,
                                 keys_only=spec.keys_only,
                                 attention_chunk_size=spec.attention_chunk_size,
                                 cache_dtype=spec.cache_dtype)
    return spec


def choose_large_page_bytes(block_bytes: list[int], max_large_page_bytes: int) -> int:
    """The exact LCM of the groups' block bytes when it is small enough, else the multiple of
    the largest block that wastes the smallest fraction of a large page in any group."""
    exact = math.lcm(*block_bytes)
    largest = max(block_bytes)
    if exact <= max(max_large_page_bytes, largest):
        return exact
    best, best_waste = largest, 1.0
    for k in range(1, max(1, max_large_page_bytes // largest) + 1):
        size = k * largest
        waste = max((size % b) / size for b in block_bytes)
        if waste < best_waste - 1e-12:
            best, best_waste = size, waste
    return best


def group_layers(layer_specs: Mapping[str, KVCacheSpec]) -> list[tuple[list[str], KVCacheSpec]]:
    """One group per distinct group key, in order of first appearance."""
    by_key: dict[tuple[object, ...], list[str]] = {}
    for name, spec in layer_specs.items():
        if isinstance(spec, EncoderOnlySpec):
            continue  # needs no KV cache
        by_key.setdefault(spec.group_key(), []).append(name)
    return [(names, merge_specs(names, [layer_specs[n] for n in names]))
            for names in by_key.values()]


def plan_kv_cache(
    layer_specs: Mapping[str, KVCacheSpec],
    memory_bytes: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    hybrid: bool = True,
    kv_sharing: Mapping[str, str] | None = None,
    max_large_page_bytes: int | None = None,
    strict: bool = True,
    enable_caching: bool = True,
    checkpoint_interval: int = 0,
    checkpoint_tail: int = DEFAULT_CHECKPOINT_TAIL,
) -> KVCachePlan:
    """Plan the KV cache of a model whose layers need `layer_specs` within `memory_bytes`.

    `kv_sharing` maps layers that compute no KV to the layer whose cache they read; they get
    no pages. Raises ValueError with a one-line reason when the budget cannot work (with
    `strict=False` a budget too small for one request is a warning instead: the `--no-hybrid`
    comparison of a model that only fits with hybrid management). With `enable_caching`,
    state layers also take checkpoint blocks (every `checkpoint_interval` blocks, 0: only at
    prompt ends and branch points; the last `checkpoint_tail` blocks of a prompt each), and
    one request of `max_model_len` must fit with them.
    """
    if memory_bytes <= 0:
        raise ValueError(f"KV cache memory must be positive, got {memory_bytes} bytes")
    if max_model_len < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_model_len and max_num_batched_tokens must be >= 1")
    kv_sharing = dict(kv_sharing or {})
    _check_kv_sharing(layer_specs, kv_sharing)
    specs = {name: (spec if hybrid else to_full_attention(spec))
             for name, spec in layer_specs.items() if name not in kv_sharing}
    grouped = group_layers(specs)
    if not grouped:
        raise ValueError("the model has no layer that needs a KV cache")

    block_bytes = [sum(specs[n].page_size_bytes for n in names) for names, _ in grouped]
    cap = max_large_page_bytes if max_large_page_bytes is not None else (
        memory_bytes // MIN_LARGE_PAGES)
    large_page = choose_large_page_bytes(block_bytes, cap)
    groups = []
    for group_id, ((names, spec), nbytes) in enumerate(zip(grouped, block_bytes, strict=True)):
        shared = tuple((layer, target) for layer, target in kv_sharing.items()
                       if target in names)
        groups.append(KVCacheGroup(
            group_id=group_id, spec=spec, layer_names=tuple(names),
            layer_page_bytes=tuple(specs[n].page_size_bytes for n in names),
            blocks_per_large_page=large_page // nbytes, shared_layers=shared,
            layer_specs=tuple(specs[n] for n in names)))
    config = KVCacheConfig(groups=tuple(groups), large_page_bytes=large_page,
                           num_large_pages=memory_bytes // large_page)
    problem = _one_request_problem(config, memory_bytes, max_model_len, max_num_batched_tokens,
                                   checkpoint_interval if enable_caching else None,
                                   checkpoint_tail)
    if problem and strict:
        raise ValueError(problem)
    plan = _figures(config, specs, memory_bytes, max_model_len, max_num_batched_tokens, hybrid)
    if problem:
        plan = replace(plan, warnings=(problem, *plan.warnings))
    return plan


def _check_kv_sharing(layer_specs: Mapping[str, KVCacheSpec],
                      kv_sharing: Mapping[str, str]) -> None:
    """A layer may read only the cache of a layer that has its own and behaves the same."""
    for layer, target in kv_sharing.items():
        if target in kv_sharing:
            raise ValueError(f"KV sharing: {layer} reads {target}, which itself reads "
                             f"{kv_sharing[target]}; point it at a layer with its own cache")
        if target not in layer_specs:
            raise ValueError(f"KV sharing: {layer} reads {target}, which has no KV cache")
        mine, theirs = layer_specs.get(layer), layer_specs[target]
        if mine is not None and (mine.group_key(), mine.page_size_bytes) != (
                theirs.group_key(), theirs.page_size_bytes):
            raise ValueError(f"KV sharing: {layer} ({mine.kind}) cannot read the cache of "
                             f"{target} ({theirs.kind}): their KV cache specs differ")


def one_request_pages(config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int,
                      checkpoint_interval: int | None,
                      checkpoint_tail: int = DEFAULT_CHECKPOINT_TAIL) -> int:
    """Large pages one request of `max_model_len` needs at its peak, the null page included
    (`checkpoint_interval` None: no prefix caching, so no state checkpoints)."""
    pages = 1
    for g in config.groups:
        blocks = g.spec.peak_blocks(max_model_len, max_num_batched_tokens)
        if checkpoint_interval is not None:
            blocks += g.spec.checkpoint_blocks(max_model_len, max_num_batched_tokens,
                                               checkpoint_interval, checkpoint_tail)
        pages += cdiv(blocks, g.blocks_per_large_page)
    return pages


def _one_request_problem(config: KVCacheConfig, memory_bytes: int, max_model_len: int,
                         max_num_batched_tokens: int,
                         checkpoint_interval: int | None, checkpoint_tail: int) -> str | None:
    pages = one_request_pages(config, max_model_len, max_num_batched_tokens,
                              checkpoint_interval, checkpoint_tail)
    if pages > config.num_large_pages:
        need = pages * config.large_page_bytes
        return (
            f"KV cache memory {format_bytes(memory_bytes)} is too small for one request of "
            f"{max_model_len} tokens, which needs {format_bytes(need)} "
            f"({pages} large pages of {format_bytes(config.large_page_bytes)}, one for the "
            f"null blocks); raise the memory or lower max_model_len")
    return None


class _RequestCost(NamedTuple):
    """What requests of max_model_len cost in a config's arena, in bytes (each block's share
    of its large page's padding included)."""

    steady: dict[int, float]  # per group: what one request holds in steady state
    widening: float  # the most one request's windows can widen in a step (peak - steady)
    transient: float  # the most a step's prefill chunks widen windows, all requests together

    @property
    def per_request(self) -> float:
        return sum(self.steady.values())

    def bytes_for(self, num_requests: float) -> float:
        # A step's chunks share one token budget, so their widening is bounded by it; and
        # no request widens past its own peak, which bounds it when requests are short
        # (max_model_len below window + budget): without that bound a 256-token Gemma 3
        # with a 2048-token step budget would reserve 129 sliding blocks it can never use.
        return (num_requests * self.per_request
                + min(self.transient, num_requests * self.widening))

    def concurrency(self, usable: float) -> float:
        """The most requests whose `bytes_for` fits `usable` bytes."""
        if self.per_request <= 0:
            return 0.0
        # bytes_for is linear in each of its two regimes: requests widening by their own
        # peak while their total is under the step's budget, then the budget.
        by_peak = usable / (self.per_request + self.widening)
        if by_peak * self.widening <= self.transient:
            return max(0.0, by_peak)
        return max(0.0, (usable - self.transient) / self.per_request)


def _request_cost(config: KVCacheConfig, max_model_len: int,
                  max_num_batched_tokens: int) -> _RequestCost:
    page = config.large_page_bytes
    cost = {g.group_id: page / g.blocks_per_large_page for g in config.groups}
    steady = {g.group_id: g.spec.steady_blocks(max_model_len) * cost[g.group_id]
              for g in config.groups}
    widening = sum(max(0, g.spec.peak_blocks(max_model_len, max_num_batched_tokens)
                       - g.spec.steady_blocks(max_model_len)) * cost[g.group_id]
                   for g in config.groups)
    transient = sum(g.spec.transient_blocks(max_num_batched_tokens) * cost[g.group_id]
                    for g in config.groups)
    return _RequestCost(steady, widening, transient)


def memory_for_requests(
    layer_specs: Mapping[str, KVCacheSpec],
    num_requests: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    hybrid: bool = True,
    kv_sharing: Mapping[str, str] | None = None,
    enable_caching: bool = True,
    checkpoint_interval: int = 0,
    checkpoint_tail: int = DEFAULT_CHECKPOINT_TAIL,
) -> int:
    """The smallest budget (whole large pages) whose plan runs `num_requests` requests of
    `max_model_len` tokens at once (`max_concurrency >= num_requests`, and room for each
    one's state checkpoints with prefix caching; one request's peak fits): the engine's
    default KV budget, max_num_seqs x max_model_len tokens' worth of each group's blocks.
    E.g. 64 requests of 8,192 tokens: 64.00 GiB for Llama-3.1-8B in bf16, 4.03 GiB for
    Gemma 3 270M in float32 (most of its layers keep 512-token windows)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    specs = {name: (spec if hybrid else to_full_attention(spec))
             for name, spec in layer_specs.items() if name not in (kv_sharing or {})}
    # From below (what the layers need, without blocks' rounding or padding) up: a larger
    # budget may choose a larger large page, so grow until the need stops growing.
    budget = max(1, sum(s.ideal_bytes(max_model_len) for s in specs.values()) * num_requests)
    for _ in range(64):
        plan = plan_kv_cache(layer_specs, budget, max_model_len=max_model_len,
                             max_num_batched_tokens=max_num_batched_tokens, hybrid=hybrid,
                             kv_sharing=kv_sharing, strict=False, enable_caching=enable_caching,
                             checkpoint_interval=checkpoint_interval,
                             checkpoint_tail=checkpoint_tail)
        config = plan.config
        cost = _request_cost(config, max_model_len, max_num_batched_tokens)
        need = cost.bytes_for(num_requests)
        if enable_caching:
            # A state group's checkpoints: each request holds them in the steps that
            # take them, so requests admitted together need theirs at once.
            need += num_requests * sum(
                g.spec.checkpoint_blocks(max_model_len, max_num_batched_tokens,
                                         checkpoint_interval, checkpoint_tail)
                * config.large_page_bytes / g.blocks_per_large_page for g in config.groups)
        pages = 1 + math.ceil(need / config.large_page_bytes)
        pages = max(pages, one_request_pages(
            config, max_model_len, max_num_batched_tokens,
            checkpoint_interval if enable_caching else None, checkpoint_tail))
        need = pages * config.large_page_bytes
        if need <= budget and plan.max_concurrency >= num_requests * (1 - 1e-12):
            return budget
        # Up to what this large page size needs (or a page more, where float rounding left
        # the concurrency a hair short): always up, so the loop ends.
        budget = max(need, budget + config.large_page_bytes)
    raise AssertionError(f"no budget for {num_requests} requests converged")  # unreachable


def _figures(config: KVCacheConfig, specs: Mapping[str, KVCacheSpec], memory_bytes: int,
             max_model_len: int, max_num_batched_tokens: int, hybrid: bool) -> KVCachePlan:
    page = config.large_page_bytes
    usable = (config.num_large_pages - 1) * page  # large page 0 holds the null blocks
    cost = _request_cost(config, max_model_len, max_num_batched_tokens)
    steady = cost.steady
    per_request = cost.per_request
    max_concurrency = cost.concurrency(usable)
    ideal_per_request = sum(spec.ideal_bytes(max_model_len) for spec in specs.values())
    padding = sum(
        g.padding_bytes_per_large_page(page) * (steady[g.group_id] / per_request) * usable / page
        for g in config.groups)
    warnings = []
    alignment = config.hit_alignment
    if alignment > max_model_len:
        warnings.append(
            f"block size {alignment} is above max_model_len {max_model_len}: no prompt fills "
            f"a block, so the prefix cache can never hit")
    return KVCachePlan(
        config=config, memory_bytes=memory_bytes, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, hybrid=hybrid,
        padding_bytes=int(padding),
        max_concurrency=max_concurrency,
        capacity_tokens=int(max_concurrency * max_model_len),
        ideal_bytes_per_token=ideal_per_request / max_model_len,
        ideal_fraction=max_concurrency / (memory_bytes / ideal_per_request),
        warnings=tuple(warnings))


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """`40GiB`, `512MB`, `1e9` or plain bytes -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
    unit = s[len(num):].strip().lower()
    try:
        value = float(num)
    except ValueError:
        value = None
    if value is None or unit not in _UNITS or value < 0:
        raise ValueError(f"cannot read {text!r} as a memory size; use bytes or a number with "
                         f"a unit such as 40GiB, 512MiB, 8GB")
    return int(value * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
