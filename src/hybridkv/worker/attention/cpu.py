"""The "cpu" attention backend: every query reads the paged KV cache in place.

At decode the torch backend's cost is mostly the copy of every context out of its blocks
(`index_select`) before SDPA reads that copy again. Here a C kernel
(worker/native/paged_attention.c) walks each request's blocks directly, one pass over its
keys and values per query. It takes every query of float32, int8 and q4 pages, prompt
chunks included: a query's arithmetic there depends only on its position and its keys,
never on the other queries of its chunk or step, so a token's attention output (and so the
K/V of the layers after) is the same bytes alone, in a chunk of 7, after a cached prefix or
in a batch (batch invariance, docs/engine.md). The torch backend's batched paths (C tiles or
SDPA over a gathered context) sum in orders that depend on the chunk. K/V writes are one C
call too (worker/cpu_ops.py), the torch backend's where the layout or dtype is not the
kernels'.

The kernel takes float32 K/V pages and int8 / q4 pages (decoded a tile at a time in the
kernel; a prompt chunk's q4 rows once per request and layer, which every query of the
chunk reads); other dtypes and K-only pages (Gemma 4) take the torch path for the whole layer.
A bias and a sink per query (Inkling: AttentionParams.query_bias / token_sinks) go to its
scored entry point on float32 and int8 pages; with a soft-cap or q4 K/V, the torch path.
`choose_backend("auto")` picks this backend on CPU devices when
the kernel compiles here, the torch backend elsewhere (CUDA runs SDPA).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from hybridkv.kv.spec import KEY_GROUP, quantized_row_bytes
from hybridkv.worker import cpu_ops, native
from hybridkv.worker.attention.backend import (
    BACKENDS,
    AttentionMetadata,
    AttentionParams,
    TorchReferenceBackend,
)
from hybridkv.worker.attention.kv_quant import write_int8_kv

logger = logging.getLogger(__name__)

# What the kernel's rows hold: float32 values, or quantized rows of a `cache_dtype`.
CODECS: dict[str | None, int] = {None: 0, "int8": 1, "q4": 2}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES: list[Any] = [
    _PTR, _I64, _I64,  # q, token stride, head stride
    _PTR, _I64, _I64,  # out, token stride, head stride
    _PTR, _I64,  # cache, what its rows hold (CODECS)
    _I64, _I64, _I64, _I64, _I64,  # cache strides in bytes: page, slot, K->V, token, head
    _I64, _I64, _I64,  # block size, kernel block size, blocks per page
    _PTR, _I64,  # block table, its row stride
    _PTR, _I64,  # rows, number of rows
    _PTR, _PTR,  # query_start_loc, seq_lens
    _I64, _I64, _I64,  # heads, KV heads, head dim
    ctypes.c_float, _I64, _I64, ctypes.c_float, _PTR,  # scale, window, chunk, softcap, sinks
    _PTR, _I64, _PTR,  # q4 K/V: fresh keys [R, F, Hk, D], their row stride, first positions
    _I64,  # threads
]
# hkv_paged_attention_scored: the same up to the sinks, no soft-cap and no q4 K/V, then the
# per-query terms (AttentionParams.query_bias / token_sinks).
_SCORED_ARGTYPES: list[Any] = [
    *_ARGTYPES[:28], _PTR,  # ... scale, window, chunk, per-head sinks
    _PTR, _I64, _I64, _I64,  # query bias [T, Hq, E], its token and head strides, E
    _PTR, _I64,  # token sinks [T, Hq], their token stride
    _I64,  # threads
]


class CPUPagedBackend(TorchReferenceBackend):
    name = "cpu"

    def __init__(self) -> None:
        kernel = native.load("paged_attention").hkv_paged_attention
        kernel.argtypes = _ARGTYPES
        kernel.restype = ctypes.c_int
        self._kernel = kernel
        scored = native.load("paged_attention").hkv_paged_attention_scored
        scored.argtypes = _SCORED_ARGTYPES
        scored.restype = ctypes.c_int
        self._scored = scored

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                params: AttentionParams) -> torch.Tensor:
        self.write(k, v, kv_cache, meta, params)
        if not _in_place_ok(q, kv_cache, meta, params):
            return self.attend(q, kv_cache, meta, params)
        rows = meta.short_rows(max_query(meta))  # every request
        if rows.numel() == 0:
            return self.attend(q, kv_cache, meta, params)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._attend_in_place(q, out, kv_cache, meta, params, rows)
        return out

    def write(self, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
              meta: AttentionMetadata, params: AttentionParams) -> None:
        if k is not None and v is not None and params.derive_kv is None and \
                kv_cache.dim() == 6 and kv_cache.dtype == torch.float32 and \
                kv_cache.stride(5) == 1 and cpu_ops.takes(k) and cpu_ops.takes(v) and \
                k.shape == v.shape == (meta.slot_mapping.shape[0], *kv_cache.shape[4:]):
            cpu_ops.write_kv(k, v, kv_cache, meta.slot_mapping, meta.block_size,
                             meta.blocks_per_page)
            return
        if k is not None and v is not None and _int8_write_ok(k, v, kv_cache, meta, params) \
                and write_int8_kv(k, v, kv_cache, meta.slot_mapping, meta.block_size,
                                  meta.blocks_per_page):
            return  # quantized in C straight into the slots (torch's bytes)
        super().write(k, v, kv_cache, meta, params)

    def _attend_in_place(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata, params: AttentionParams,
                         rows: torch.Tensor) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        table = meta.block_table
        if table.stride(1) != 1 or table.dtype != torch.int64:
            table = table.to(torch.int64).contiguous()
        query_start_loc, seq_lens = meta.host_lens
        sinks = params.sinks
        if sinks is not None:
            sinks = sinks.detach().float().contiguous()
        cs = [stride * kv_cache.element_size() for stride in kv_cache.stride()]
        if params.scores_per_query:
            status = self._scored_in_place(q, out, kv_cache, meta, params, rows, table, cs,
                                           sinks)
            self._check(status, num_heads, kv_cache.shape[4], head_dim)
            return
        fresh = starts = None
        if meta.key_groups:
            keys = meta.fresh[kv_cache.data_ptr()]
            fresh = keys.keys if keys.keys.is_contiguous() else keys.keys.contiguous()
            starts = torch.tensor(keys.starts, dtype=torch.int64)
        status = self._kernel(
            q.data_ptr(), q.stride(0), q.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            kv_cache.data_ptr(), CODECS[meta.cache_dtype], cs[0], cs[1], cs[2], cs[3], cs[4],
            meta.block_size, meta.kernel_block_size, meta.blocks_per_page,
            table.data_ptr(), table.stride(0),
            rows.data_ptr(), rows.numel(),
            query_start_loc.data_ptr(), seq_lens.data_ptr(),
            num_heads, kv_cache.shape[4], head_dim,
            params.scale, params.sliding_window or 0, params.chunk_size or 0,
            params.softcap or 0.0, None if sinks is None else sinks.data_ptr(),
            None if fresh is None else fresh.data_ptr(),
            0 if fresh is None else fresh.stride(0),
            None if starts is None else starts.data_ptr(),
            torch.get_num_threads())  # the kernel splits only where it has several items
        self._check(status, num_heads, kv_cache.shape[4], head_dim)

    def _scored_in_place(self, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata, params: AttentionParams, rows: torch.Tensor,
                         table: torch.Tensor, cs: list[int], sinks: torch.Tensor | None
                         ) -> int:
        """The in-place kernel with a bias and/or a sink per query (float32 or int8 pages)."""
        query_start_loc, seq_lens = meta.host_lens
        bias = token_sinks = None
        if params.query_bias is not None:
            bias = params.query_bias.detach().float().contiguous()  # [T, Hq, E]
        if params.token_sinks is not None:
            token_sinks = params.token_sinks.detach().float().contiguous()  # [T, Hq]
        return int(self._scored(
            q.data_ptr(), q.stride(0), q.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            kv_cache.data_ptr(), CODECS[meta.cache_dtype], cs[0], cs[1], cs[2], cs[3], cs[4],
            meta.block_size, meta.kernel_block_size, meta.blocks_per_page,
            table.data_ptr(), table.stride(0),
            rows.data_ptr(), rows.numel(),
            query_start_loc.data_ptr(), seq_lens.data_ptr(),
            q.shape[1], kv_cache.shape[4], q.shape[2],
            params.scale, params.sliding_window or 0, params.chunk_size or 0,
            None if sinks is None else sinks.data_ptr(),
            None if bias is None else bias.data_ptr(),
            0 if bias is None else bias.stride(0), 0 if bias is None else bias.stride(1),
            0 if bias is None else bias.shape[2],
            None if token_sinks is None else token_sinks.data_ptr(),
            0 if token_sinks is None else token_sinks.stride(0),
            torch.get_num_threads()))

    @staticmethod
    def _check(status: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if status == -2:
            raise MemoryError("paged attention could not allocate its work list")
        if status != 0:
            raise RuntimeError(f"paged attention kernel refused its arguments ({status}): "
                               f"{num_heads} heads, {num_kv_heads} KV heads, "
                               f"head dim {head_dim}")


def max_query(meta: AttentionMetadata) -> int:
    """The longest query run the in-place kernel takes: every run, for every page dtype it
    reads (batch invariant)."""
    return max(meta.query_lens, default=0)


def _int8_write_ok(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata, params: AttentionParams) -> bool:
    """float32 K/V rows of unit stride into int8 K/V pages [pages, per_page, 2, block, Hk,
    row bytes] by int64 slots (the C writer's one layout)."""
    return (params.derive_kv is None and meta.cache_dtype == "int8" and kv_cache.dim() == 6
            and kv_cache.dtype == torch.uint8 and kv_cache.stride(5) == 1
            and k.dtype == v.dtype == torch.float32 and k.stride(2) == v.stride(2) == 1
            and k.shape == v.shape
            and k.shape[:2] == (meta.slot_mapping.shape[0], kv_cache.shape[4])
            and quantized_row_bytes("int8", k.shape[2]) == kv_cache.shape[5]
            and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous())


def _in_place_ok(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 params: AttentionParams) -> bool:
    """Float32 or int8 / q4 K/V pages on the CPU, rows of unit stride (the kernel's one
    layout)."""
    page_dtype = torch.float32 if meta.cache_dtype is None else torch.uint8
    if (meta.cache_dtype == "q4") != meta.key_groups:
        return False  # the kernel reads q4 K/V pages only, not q4 rows per token
    if meta.key_groups and meta.kernel_block_size % KEY_GROUP:
        return False
    if params.scores_per_query and (params.softcap is not None or meta.key_groups):
        return False  # the scored kernel takes neither: the torch path
    return (q.device.type == "cpu" and q.dtype == torch.float32
            and meta.cache_dtype in CODECS and kv_cache.dtype == page_dtype
            and kv_cache.dim() == 6 and params.derive_kv is None and q.stride(2) == 1
            and kv_cache.stride(5) == 1 and q.shape[1] * q.shape[2] <= 1 << 16
            and q.shape[2] <= 1024)


BACKENDS["cpu"] = CPUPagedBackend


def choose_backend(name: str, device: torch.device | str) -> str:
    """"auto": the in-place CPU kernel on CPU devices where it compiles, else torch."""
    if name != "auto":
        return name
    if torch.device(device).type != "cpu":
        return "torch"
    try:
        native.load("paged_attention")
    except native.NativeBuildError as exc:
        logger.warning("attention backend 'cpu' unavailable (%s); using 'torch'", exc)
        return "torch"
    return "cpu"
