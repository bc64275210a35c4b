"""KV cache specs: what one layer needs from the KV cache.

A spec answers three sizing questions for one layer:
- `page_size_bytes`: the bytes one block of this layer occupies;
- `peak_blocks(...)`: the most blocks one request can hold at once (prefill transient included),
  used to refuse budgets that cannot run even one request;
- `steady_blocks(...)` and `ideal_bytes(...)`: what a long-running request holds in steady
  state, and the exact physical minimum, used for capacity figures.

Layers whose specs have the same `group_key` share a KV cache group (one block table, one
manager); their pages may differ in size (different head counts), the group's block is then
the sum of its layers' pages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_DTYPE_BYTES = {
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1,
    "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
    "fp32": 4, "float32": 4, "float": 4,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name (`bf16`, `float32`, `fp8`, ...)."""
    try:
        return _DTYPE_BYTES[dtype.lower()]
    except KeyError:
        accepted = ", ".join(sorted(_DTYPE_BYTES))
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {accepted}") from None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Quantized KV pages (`kv_cache_dtype`). A quantized page stores each token's K (or V, or
# latent) row of one head as
#
#     [fp16 scale (q4: scale and minimum) of each group of QUANT_GROUP values | the values]
#
# padded to an even length so that every row's scales stay 2-byte aligned. The scales live in
# the page, next to their values: a block is self-contained, so every tier and the prefix
# cache move quantized blocks as plain bytes. Values: int8 (x / scale, scale = max|x| / 127),
# q4 (4-bit, (x - min) / scale with scale = (max - min) / 15, after a Hadamard rotation of each
# full group, which spreads outliers over the group; in each group byte i holds value i in its
# low nibble and value i + 16 in its high one), fp8 (e4m3 of x / scale, scale = max|x| / 448).
#
# q4 on K/V pages (not K-only or latent pages) quantizes K and V differently, because keys
# carry large per-channel offsets (a few channels far from zero in every token) that no
# per-token grouping resolves in 4 bits (perplexity +5% against +1.1% on SmolLM2, `hybridkv
# bench kv-quant`):
#   - K: per channel over each group of KEY_GROUP consecutive tokens (a scale and a minimum
#     per channel and group, as KIVI does), no rotation. A group is quantized once its
#     KEY_GROUP tokens are known; until then its keys are read in full precision from the
#     worker's staging buffer (worker/attention/kv_quant.py), so a query sees every key
#     before its own group quantized and its own group's exactly, however the prompt was
#     chunked.
#   - V: per token, rotated as above, symmetric: (x / scale) + 8 in a nibble, scale =
#     max|x| / 7 per group of QUANT_GROUP (an fp16 scale per group).
# Both rows of a token are `q4_kv_layout(D).row` bytes: the K row holds the nibbles and the
# first `k_tail` bytes of the token's share of its group's (scale, minimum) pairs, the V row
# holds its scales, nibbles and the rest of that share (`v_tail` bytes). Token i of a group
# holds the pairs of channels [i * C, (i + 1) * C), C = ceil(D / KEY_GROUP).
QUANT_GROUP = 32
KEY_GROUP = 16
CACHE_DTYPES = ("int8", "q4", "fp8")


def quantized_row_bytes(cache_dtype: str, head_size: int) -> int:
    """Bytes of one quantized row of `head_size` values. E.g. int8, 256 -> 16 + 256 = 272
    (float32: 1,024); q4, 256 -> 32 + 128 = 160; int8, 65 -> 6 + 65 + 1 pad = 72. (q4 on
    K/V pages: `q4_kv_layout`.)"""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {cache_dtype!r}; accepted: auto, "
                         f"{', '.join(CACHE_DTYPES)}")
    scales = (4 if cache_dtype == "q4" else 2) * cdiv(head_size, QUANT_GROUP)
    values = cdiv(head_size, 2) if cache_dtype == "q4" else head_size
    return 2 * cdiv(scales + values, 2)


@dataclass(frozen=True)
class Q4KVLayout:
    """Byte layout of q4 K/V rows of one head size (see the comment above)."""

    head_size: int
    row: int  # bytes of a K row and of a V row
    nibbles: int  # ceil(D / 2): a row's 4-bit values
    channels: int  # C: channels whose (scale, minimum) pairs one token of a group holds
    k_tail: int  # bytes of a token's share in its K row, after the nibbles
    v_tail: int  # the rest of the share, in its V row after the V row's own bytes
    v_bytes: int  # a V row's own bytes: fp16 scale per QUANT_GROUP, then the nibbles

    @property
    def share(self) -> int:
        return 4 * self.channels  # (fp16 scale, fp16 minimum) per channel


@functools.lru_cache(maxsize=64)
def q4_kv_layout(head_size: int) -> Q4KVLayout:
    """E.g. 64 -> rows of 42 bytes (32 nibbles + 10, 4 scale bytes + 32 nibbles + 6), against
    256 bytes of float32: 6.1x."""
    nibbles = cdiv(head_size, 2)
    channels = cdiv(head_size, KEY_GROUP)
    v_bytes = 2 * cdiv(head_size, QUANT_GROUP) + nibbles
    row = 2 * cdiv(nibbles + 4 * channels + v_bytes, 4)  # two even rows hold K and V
    k_tail = min(row - nibbles, 4 * channels)
    return Q4KVLayout(head_size, row, nibbles, channels, k_tail, 4 * channels - k_tail,
                      v_bytes)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of all specs. `block_size` is in tokens (for state specs: the hash alignment)."""

    block_size: int
    kind = "base"
    # A fixed-size state per request (one block, checkpoints at hit points) rather than pages
    # of tokens; managers, planner and worker branch on this, not on `kind` strings.
    is_state = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def group_key(self) -> tuple[object, ...]:
        """Layers with equal keys behave identically for the manager and share a group."""
        return (self.kind, self.block_size)

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        raise NotImplementedError

    def steady_blocks(self, num_tokens: int) -> int:
        raise NotImplementedError

    def checkpoint_blocks(self, max_model_len: int, max_num_batched_tokens: int,
                          checkpoint_interval: int, checkpoint_tail: int) -> int:
        """Blocks one request holds at most on top of `peak_blocks` when the prefix cache
        saves state checkpoints (`checkpoint_interval` in blocks, 0: none; the last
        `checkpoint_tail` blocks of a prompt each). State kinds only."""
        return 0

    def transient_blocks(self, max_num_batched_tokens: int) -> int:
        """Extra blocks one step's prefill chunk can need on top of `steady_blocks`."""
        return 0

    def ideal_bytes(self, num_tokens: int) -> int:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: str = "bf16"
    # A K-only page: the values are a function of the keys' projection (Gemma 4's
    # values-equal-keys layers), so a page holds that projection alone and the layer derives
    # K and V from it when it reads the page. Same manager policy, half the bytes.
    keys_only: bool = False
    # How pages store K/V: None, in `dtype`; else one of CACHE_DTYPES (rows of values and
    # their scales, see `quantized_row_bytes`). Layers still compute K/V in `dtype`.
    cache_dtype: str | None = None
    # Pages of latents (multi-head latent attention): one vector per token, no K/V halves
    # (MLAAttentionSpec, MLASlidingWindowSpec).
    latent = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache_dtype is not None:
            quantized_row_bytes(self.cache_dtype, self.head_size)  # a known dtype
        if self.latent and self.keys_only:
            raise ValueError(f"{type(self).__name__} pages hold latents; keys_only does not "
                             f"apply")
        if self.q4_kv and self.block_size % KEY_GROUP:
            raise ValueError(f"kv_cache_dtype 'q4' quantizes keys per {KEY_GROUP} tokens, "
                             f"which needs a block size that is a multiple of {KEY_GROUP}, "
                             f"got {self.block_size}")

    @property
    def q4_kv(self) -> bool:
        """q4 K/V pages of self-attention: keys per channel over token groups
        (`q4_kv_layout`). Cross-attention pages, written once from the encoder, keep q4
        rows per token."""
        return (self.cache_dtype == "q4" and self.kv_halves == 2
                and self.kind != "cross_attention")

    @property
    def kv_halves(self) -> int:
        """Rows per token and head: K and V (2), or one (raw keys, latents)."""
        return 1 if self.keys_only or self.latent else 2

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row of one head (K, V or a latent) in a page."""
        if self.cache_dtype is None:
            return self.head_size * dtype_size(self.dtype)
        if self.q4_kv:
            return q4_kv_layout(self.head_size).row
        return quantized_row_bytes(self.cache_dtype, self.head_size)

    @property
    def page_dtype(self) -> str:
        """What a page holds: the quantized dtype, or the model's."""
        return self.cache_dtype or self.dtype

    def group_key(self) -> tuple[object, ...]:
        # Pages of another dtype are another layout: never one block table.
        return (self.kind, self.block_size, self.cache_dtype)

    @property
    def bytes_per_token(self) -> int:
        # K and V (or the keys alone), each [num_kv_heads, head_size].
        return self.kv_halves * self.num_kv_heads * self.row_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token's KV is kept. With hybrid management off, sliding-window and chunked layers
    become full attention and keep their window/chunk here, for the kernel's mask only."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    kind = "full"

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size)

    def steady_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def ideal_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token instead of K and V.
    `head_size` is the latent width (kv_lora_rank + rope dim), `num_kv_heads` is 1."""

    latent = True


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A token attends to itself and the `sliding_window - 1` tokens before it."""

    sliding_window: int
    kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def group_key(self) -> tuple[object, ...]:
        return (self.kind, self.block_size, self.sliding_window, self.cache_dtype)

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # The window before a prefill chunk plus the chunk itself, and one block because the
        # window need not start on a block boundary.
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def steady_blocks(self, num_tokens: int) -> int:
        # E.g. window 1024, block 16: a window straddles at most 64 + 1 blocks.
        window_blocks = cdiv(self.sliding_window - 1, self.block_size) + 1
        return min(cdiv(num_tokens, self.block_size), window_blocks)

    def transient_blocks(self, max_num_batched_tokens: int) -> int:
        return cdiv(max_num_batched_tokens, self.block_size) + 1

    def ideal_bytes(self, num_tokens: int) -> int:
        return min(num_tokens, self.sliding_window) * self.bytes_per_token


@dataclass(frozen=True, kw_only=True)
class MLASlidingWindowSpec(SlidingWindowSpec):
    """Multi-head latent attention over a sliding window (dots3_note's sliding layers): the
    sliding window's manager policy over pages of latents (see MLAAttentionSpec)."""

    latent = True


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """A token attends only to tokens of its own chunk of `attention_chunk_size` positions."""

    attention_chunk_size: int
    kind = "chunked_local"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_chunk_size < 1:
            raise ValueError(
                f"attention_chunk_size must be >= 1, got {self.attention_chunk_size}")

    def group_key(self) -> tuple[object, ...]:
        return (self.kind, self.block_size, self.attention_chunk_size, self.cache_dtype)

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        num_tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def steady_blocks(self, num_tokens: int) -> int:
        chunk_blocks = cdiv(self.attention_chunk_size, self.block_size)
        if self.attention_chunk_size % self.block_size:
            chunk_blocks += 1  # a chunk can straddle one more block
        return min(cdiv(num_tokens, self.block_size), chunk_blocks)

    def transient_blocks(self, max_num_batched_tokens: int) -> int:
        return cdiv(max_num_batched_tokens, self.block_size) + 1

    def ideal_bytes(self, num_tokens: int) -> int:
        return min(num_tokens, self.attention_chunk_size) * self.bytes_per_token


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder layers attending to encoder outputs: sized by the encoder length, written once."""

    max_encoder_len: int
    kind = "cross_attention"

    def group_key(self) -> tuple[object, ...]:
        return (self.kind, self.block_size, self.max_encoder_len, self.cache_dtype)

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(self.max_encoder_len, self.block_size)

    def steady_blocks(self, num_tokens: int) -> int:
        return cdiv(self.max_encoder_len, self.block_size)

    def ideal_bytes(self, num_tokens: int) -> int:
        return self.max_encoder_len * self.bytes_per_token


@dataclass(frozen=True, kw_only=True)
class IndexerKeySpec(KVCacheSpec):
    """A lightning indexer's keys: what the indexer scores each query against to choose
    the entries its layer's attention reads (top-k per query; DeepSeek-V3.2's DSA,
    dots3_note). One key of `head_size` values per entry and an entry per `compress_rate`
    tokens (1: one per token; a compressing indexer averages `compress_rate` tokens' keys
    into one entry), in `dtype`: the indexer's own, whatever the attention pages hold.

    Every query scores every earlier entry, so a request keeps all of them, as full
    attention keeps its K/V, and a prefix hit needs the entries of every cached position.
    A block of `block_size` tokens holds `block_size // compress_rate` whole entries, so a
    hit, which ends on a block boundary, ends on an entry boundary."""

    head_size: int
    dtype: str = "bf16"
    compress_rate: int = 1
    kind = "indexer_key"

    def __post_init__(self) -> None:
        super().__post_init__()
        dtype_size(self.dtype)  # a known dtype
        if self.head_size < 1 or self.compress_rate < 1:
            raise ValueError(f"indexer keys need head_size >= 1 and compress_rate >= 1, got "
                             f"{self.head_size} and {self.compress_rate}")
        if self.block_size % self.compress_rate:
            raise ValueError(f"indexer keys compressed per {self.compress_rate} tokens need a "
                             f"block size that is a multiple of it, got {self.block_size}")

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.compress_rate

    @property
    def bytes_per_entry(self) -> int:
        return self.head_size * dtype_size(self.dtype)

    @property
    def page_dtype(self) -> str:
        return self.dtype

    def group_key(self) -> tuple[object, ...]:
        return (self.kind, self.block_size, self.compress_rate, self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.entries_per_block * self.bytes_per_entry

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size)

    def steady_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def ideal_bytes(self, num_tokens: int) -> int:
        # Entries of whole `compress_rate` windows; the tokens of an unfinished window are
        # not an entry yet.
        return num_tokens // self.compress_rate * self.bytes_per_entry


@dataclass(frozen=True, kw_only=True)
class CompressedAttentionSpec(KVCacheSpec):
    """Compressed attention (DeepSeek-V4's CSA and HCA): a compressor folds each window of
    `compress_rate` tokens into one entry of `head_size` values per KV head (K = V: one row,
    as MLA's latents), which every later query attends to (HCA: all of them; CSA: the top k
    of them its lightning indexer chooses, whose keys are an IndexerKeySpec of their own).

    A block of `block_size` tokens holds `block_size // compress_rate` entries, so a block
    of B entries covers B x rate tokens and a hit, which ends on a block boundary, ends on a
    window boundary. No entry ever falls out of use: a request keeps them all and a hit
    needs every one before it, as full attention needs every K/V. The window's tokens
    before it closes are the compressor's state (CompressorStateSpec), not entries."""

    head_size: int
    compress_rate: int
    num_kv_heads: int = 1
    dtype: str = "bf16"
    kind = "compressed"

    def __post_init__(self) -> None:
        super().__post_init__()
        dtype_size(self.dtype)  # a known dtype
        if min(self.head_size, self.compress_rate, self.num_kv_heads) < 1:
            raise ValueError(f"compressed attention needs head_size, compress_rate and "
                             f"num_kv_heads >= 1, got {self.head_size}, "
                             f"{self.compress_rate} and {self.num_kv_heads}")
        if self.block_size % self.compress_rate:
            raise ValueError(f"compressed attention entries per {self.compress_rate} tokens "
                             f"need a block size that is a multiple of it, got "
                             f"{self.block_size}")

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.compress_rate

    @property
    def bytes_per_entry(self) -> int:
        return self.num_kv_heads * self.head_size * dtype_size(self.dtype)

    @property
    def page_dtype(self) -> str:
        return self.dtype

    def group_key(self) -> tuple[object, ...]:
        return (self.kind, self.block_size, self.compress_rate, self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return self.entries_per_block * self.bytes_per_entry

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size)

    def steady_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def ideal_bytes(self, num_tokens: int) -> int:
        # Closed windows only: an unfinished window's tokens are still compressor state.
        return num_tokens // self.compress_rate * self.bytes_per_entry


# State checkpoints a request keeps near its ends, in blocks: at each of the last this many
# block boundaries of its prompt and of its output (kv/managers/mamba.py). A chat's next
# request parts from this one there: an edited last message, or an answer whose text
# tokenizes differently when it is sent back.
DEFAULT_CHECKPOINT_TAIL = 4


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A fixed-size recurrent state per request (conv state + SSM state, or a linear-attention
    state). One block holds one state; `block_size` is the attention block size that state
    checkpoints align to.

    `num_speculative_blocks` extra states are held for the request's whole life (vLLM's
    layout for drafts: one per draft token; hybridkv's speculative decoding uses none).

    Speculative decoding: a step that scores a request's drafts holds `num_drafting_blocks`
    (one) more state, the state at its known tokens, copied back over the live state if a
    draft is rejected and freed with the step; at most `max_speculative_requests` requests
    draft in one step, so the states of N requests take N + min(N, max_speculative_requests)
    blocks at most (`with_speculative_states`)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    num_speculative_blocks: int = 0
    num_drafting_blocks: int = 0
    max_speculative_requests: int = 0
    kind = "mamba"
    is_state = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"MambaSpec needs one dtype per state shape, got {len(self.shapes)} shapes "
                f"and {len(self.dtypes)} dtypes")

    @property
    def page_size_bytes(self) -> int:
        return sum(math.prod(shape) * dtype_size(dtype)
                   for shape, dtype in zip(self.shapes, self.dtypes, strict=True))

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return 1 + self.num_speculative_blocks + self.num_drafting_blocks

    def steady_blocks(self, num_tokens: int) -> int:
        return 1 + self.num_speculative_blocks

    def transient_blocks(self, max_num_batched_tokens: int) -> int:
        return self.num_drafting_blocks * self.max_speculative_requests

    def checkpoint_blocks(self, max_model_len: int, max_num_batched_tokens: int,
                          checkpoint_interval: int, checkpoint_tail: int) -> int:
        # In the step that resumes from a hit, a request holds the checkpoint it resumes
        # from and takes one for each position its tokens cross: the boundaries of the
        # prompt's tail (`checkpoint_tail` + 1 for a prompt of whole blocks:
        # kv/managers/mamba.py), the branch point and every interval position (the output's
        # block boundaries only in steps of output alone, which cross no prompt end). All
        # are block-aligned and within the request. E.g. block 16, tail 1, interval 4 (64
        # tokens), 512-token steps: 1 + 3 + 9 = 13 blocks.
        num_tokens = min(max_num_batched_tokens, max_model_len)
        crossed = checkpoint_tail + 2
        if checkpoint_interval:
            crossed += num_tokens // (checkpoint_interval * self.block_size) + 1
        return 1 + min(crossed, max_model_len // self.block_size)

    def ideal_bytes(self, num_tokens: int) -> int:
        return self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class CompressorStateSpec(MambaSpec):
    """A compressed-attention layer's compressor state (DeepSeek-V4): per request, the
    projections of the tokens since its last closed window (at most `compress_rate - 1`
    tokens' kv and gate rows, of the layer's compressor and of its indexer's) and, where
    windows overlap (`overlap`, CSA: entry w mixes window w-1's first half-projections with
    window w's second ones), the last closed window's first halves. `shapes` hold them all.

    What a prefix hit needs, at a hit point p (a multiple of `compress_rate`, as every
    block boundary is):
      - the buffer is empty at p (p - p // rate * rate = 0 tokens), so no buffer is needed;
      - without overlap (HCA) nothing else is carried across windows: the hit needs no
        state at all, and a fresh live state serves (its fill is p mod rate = 0);
      - with overlap (CSA) entry p / rate needs window p / rate - 1's first halves, which
        are projections of tokens [p - rate, p) inside the hit: the hit needs the state
        checkpoint at p, Mamba's rule (kv/managers/compressor_state.py).
    One live state per request either way, kept for the request's life."""

    compress_rate: int
    overlap: bool = False
    kind = "compressor_state"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compress_rate < 1 or self.block_size % self.compress_rate:
            raise ValueError(f"a compressor state of windows of {self.compress_rate} tokens "
                             f"needs a block size that is a multiple of it, got "
                             f"{self.block_size}")

    def group_key(self) -> tuple[object, ...]:
        # The two hit rules (overlap or not) never share a group.
        return (self.kind, self.block_size, self.compress_rate, self.overlap)

    def checkpoint_blocks(self, max_model_len: int, max_num_batched_tokens: int,
                          checkpoint_interval: int, checkpoint_tail: int) -> int:
        if not self.overlap:
            return 0  # hits need no checkpoint, so none is taken
        return super().checkpoint_blocks(max_model_len, max_num_batched_tokens,
                                         checkpoint_interval, checkpoint_tail)


@dataclass(frozen=True, kw_only=True)
class EncoderOnlySpec(KVCacheSpec):
    """Bidirectional encoder attention: recomputed for every request, needs no KV cache."""

    kind = "encoder_only"

    @property
    def page_size_bytes(self) -> int:
        return 0

    def peak_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return 0

    def steady_blocks(self, num_tokens: int) -> int:
        return 0

    def ideal_bytes(self, num_tokens: int) -> int:
        return 0


def merge_specs(layer_names: Sequence[str], specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
    """The representative spec of layers that are to share one group.

    Layers of one kind may differ in page size (their block bytes add up); they must agree on
    everything the manager uses (kind, block size, window, chunk, encoder length).
    """
    if not specs:
        raise ValueError("cannot merge an empty list of KV cache specs")
    first = specs[0]
    for name, spec in zip(layer_names, specs, strict=True):
        if spec.group_key() != first.group_key():
            raise ValueError(
                f"cannot put layer {name!r} ({_describe(spec)}) in the group of "
                f"{layer_names[0]!r} ({_describe(first)}): KV cache specs differ")
    return first


def _describe(spec: KVCacheSpec) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(
        ("kind", "block_size", "param"), spec.group_key(), strict=False))


# With speculative decoding, the share of the running requests whose drafts one step may
# score on a model with state layers: each holds one more state during that step, so the
# states take at most 1.3x what they take without drafts (vLLM keeps 1 + K per request).
SPECULATIVE_STATE_SHARE = 0.3


def with_speculative_states(specs: Mapping[str, KVCacheSpec], max_num_seqs: int
                            ) -> dict[str, KVCacheSpec]:
    """The layer specs of a model run with speculative decoding: a state layer's drafting
    step holds one more state, and at most SPECULATIVE_STATE_SHARE of `max_num_seqs`
    requests (one at least) draft in one step; the planner counts those states. Attention
    layers need nothing: a rejected draft's slot is written again by the token that takes
    its place."""
    drafting = max(1, math.floor(SPECULATIVE_STATE_SHARE * max_num_seqs))
    return {name: dataclasses.replace(spec, num_drafting_blocks=1,
                                      max_speculative_requests=drafting)
            if isinstance(spec, MambaSpec) else spec for name, spec in specs.items()}
