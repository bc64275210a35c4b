"""A decode step's decoder layers in one C call (worker/native/decode_layers.c).

At batch 1 a small quantized model's layers are mostly overhead: Gemma 3 270M's 18 layers
run ~25 operators each (norms, projections, RoPE, the K/V write, attention, activation,
residual adds), each a Python call, a torch dispatch and an allocation, ~6-7 ms of a
~30 ms step. `NativeDecode` describes the layers once, at load, as the C side's structs
(norm weights, quantized matrices, attention shape, KV pages), and runs a step in which
every token is a decode through them in one call, with the same kernels the operator path
calls, the gated activation included (so the same bytes: worker/native/quant_gemm.c gives a
row the same result in any batch).

It takes the common layer only: pre-norm attention with optional q/k norms, RoPE and
Gemma's sandwich norms, then a gated SiLU / GELU-tanh MLP, every projection GGUF-quantized
without bias, float32 K/V pages and the C attention backend. `attach` says in one line
why a model does not fit; a step that does not fit (prefill tokens, more rows
than `max_rows`, quantized K/V, 8-bit activations) takes the operator
path.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.layers.attention import Attention
from hybridkv.models.layers.decoder_layer import DecoderLayer
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary
from hybridkv.worker import cpu_ops, native
from hybridkv.worker.attention.backend import AttentionMetadata
from hybridkv.worker.attention.cpu import CPUPagedBackend, max_query
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.linear import quant as quant_linear
from hybridkv.worker.linear.layers import GatedLinear, Linear

logger = logging.getLogger(__name__)
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
MAX_PARTS = 3
# Decode rows a step may have here (past them the operator path's per-op overhead is small).
MAX_ROWS = 127
_ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2, "gelu_new": 2}


class Matrix(ctypes.Structure):
    _fields_ = [("w", _PTR), ("ldw", _I64), ("type", _I64), ("rows", _I64), ("order", _PTR)]


class Layer(ctypes.Structure):
    _fields_ = [("in_norm", _PTR), ("post_attn_norm", _PTR), ("pre_ffn_norm", _PTR),
                ("post_ffn_norm", _PTR), ("q_norm", _PTR), ("k_norm", _PTR),
                ("norm_offset", _F32), ("eps", _F32), ("qk_offset", _F32), ("qk_eps", _F32),
                ("qkv", Matrix * MAX_PARTS), ("n_qkv", _I64), ("o", Matrix),
                ("gate_up", Matrix * MAX_PARTS), ("n_gate_up", _I64), ("down", Matrix),
                ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("intermediate", _I64), ("act", _I64), ("rope", _I64), ("rotary_dim", _I64),
                ("scale", _F32), ("softcap", _F32), ("window", _I64), ("cache", _PTR),
                ("cs", _I64 * 5), ("group", _I64)]


class Group(ctypes.Structure):
    _fields_ = [("block_table", _PTR), ("slot_mapping", _PTR), ("rows", _PTR),
                ("query_start_loc", _PTR), ("seq_lens", _PTR), ("table_stride", _I64),
                ("num_rows", _I64), ("block_size", _I64), ("kernel_block_size", _I64),
                ("blocks_per_page", _I64)]


class Kernels(ctypes.Structure):
    _fields_ = [("rms_norm", _PTR), ("rope", _PTR), ("write_kv", _PTR), ("attention", _PTR),
                ("matmul", _PTR)]


class Unfit(ValueError):
    """Why a model's layers cannot run as one call (one line)."""


def _address(fn: Any) -> int:
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


def _matrices(linear: Any, what: str, cols: int, ordered: bool = False) -> list[Matrix]:
    """The C structs of a projection's quantized parts; `ordered`: parts may carry a row
    order (the C side orders q/k/v outputs only)."""
    parts = getattr(linear, "quantized", None) if isinstance(linear, Linear) else None
    if parts is None or parts.bias is not None or not 0 < len(parts.weights) <= MAX_PARTS:
        raise Unfit(f"{what} is not a GGUF-quantized projection without bias")
    out = []
    for w in parts.weights:
        if w.cols != cols or w.data.stride(1) != 1:
            raise Unfit(f"{what} reads {w.cols} values, not {cols}")
        if not quant_linear.takes_gemm(w.qtype, w.cols):
            raise Unfit(f"{what} is {w.type_name} x {w.cols}, which the one-order kernel "
                        f"does not take")
        order = w.row_order
        if order is not None and (not ordered or order.dtype != torch.int64
                                  or not order.is_contiguous()):
            raise Unfit(f"{what} has its rows in another order than the file's")
        out.append(Matrix(w.data.data_ptr(), w.data.stride(0), w.qtype, w.rows,
                          None if order is None else order.data_ptr()))
    return out


def _norm(module: Any, what: str) -> tuple[int, float, float] | None:
    """(weight address, offset, eps) of a C-ready RMSNorm; None where there is none."""
    if module is None:
        return None
    if type(module) is not RMSNorm or not module.native_ops or \
            module.weight.dtype != torch.float32 or not module.weight.is_contiguous():
        raise Unfit(f"{what} is not a float32 RMSNorm on the C ops")
    return module.weight.data_ptr(), float(module.offset), float(module.eps)


@dataclass
class _Step:
    """What a step fills in: per group its metadata tensors (kept alive for the call)."""

    groups: Any
    keep: list[torch.Tensor]


class NativeDecode:
    """The layers of a model as C descriptors; `__call__` runs a decode step through them."""

    def __init__(self, model: nn.Module) -> None:
        """Raises Unfit (one line) where a layer is not the kind the C sequence runs."""
        if not quant_linear.available():
            raise Unfit("the C kernels are not built here")
        if not isinstance(model, CausalLM):
            raise Unfit("the model is not a CausalLM")
        for hook in ("per_layer_inputs", "enter_layers", "leave_layers"):
            if getattr(type(model), hook) is not getattr(CausalLM, hook):
                raise Unfit(f"the model changes {hook}")
        layers = list(model.model.layers)  # type: ignore[arg-type]
        if model.kv_shared_from not in (None, len(layers)):
            raise Unfit("some layers read another layer's KV")
        self.hidden = model.cfg.hidden_size
        self.names: list[str] = []
        self.rotaries: list[Rotary] = []
        structs = []
        for i, layer in enumerate(layers):
            structs.append(self._describe(i, layer))
        self.layers = (Layer * len(structs))(*structs)
        # Whether every matrix takes 8-bit activations where they are on (the C call then
        # runs quant.c's kernel on all of them, as the operator path does).
        self.int8_ready = all(
            quant_linear.int8_capable(mat.type)
            for L in structs for mat in (*L.qkv[:L.n_qkv], L.o, *L.gate_up[:L.n_gate_up], L.down))
        # The product's address per activations (float or 8-bit), the setting read per step.
        self.matmuls = {True: quant_linear.gemm_address(True),
                        False: quant_linear.gemm_address(False) if self.int8_ready else 0}
        lib = library()
        attention = native.load("paged_attention").hkv_paged_attention
        ops = cpu_ops.library()
        self.max_rows = MAX_ROWS
        self.kernels = Kernels(_address(ops.hkv_rms_norm_f32), _address(ops.hkv_rope_f32),
                               _address(ops.hkv_write_kv_f32), _address(attention),
                               self.matmuls[quant_linear.FLOAT_ACTIVATIONS])
        self.scratch = torch.empty(int(lib.hkv_decode_scratch(self.layers, len(structs),
                                                                self.max_rows, self.hidden)),
                                   dtype=torch.float32)
        self.cache_ptrs: list[int] = [0] * len(structs)
        self.group_of: list[int] = [-1] * len(structs)
        self._run = lib.hkv_decode_layers
        self.refused: str | None = None  # set once a step's KV pages do not fit

    def _describe(self, i: int, layer: Any) -> Layer:
        where = f"layer {i}"
        if type(layer) is not DecoderLayer or layer.residual_multiplier != 1.0:
            raise Unfit(f"{where} is not a plain decoder layer")
        n = layer.names
        attn = getattr(layer, n.mixer) if n.mixer is not None else None
        if type(attn) is not Attention or len(n.ffns) != 1:
            raise Unfit(f"{where} is not attention then one MLP")
        s = attn.shape
        if (attn.reads_shared_kv or attn.keys_only or attn.sinks is not None or s.output_gate
                or s.key_multiplier != 1.0 or s.value_norm or not (attn.has_k and attn.has_v)
                or attn.params.chunk_size or attn.params.derive_kv is not None
                or attn.kv_deriver is not None):
            raise Unfit(f"{where}'s attention has a variant the C sequence lacks")
        hidden = s.hidden_size
        qkv = _matrices(attn.qkv, f"{where}'s q/k/v", hidden, ordered=True)
        o = _matrices(attn.o_proj, f"{where}'s o_proj", s.num_heads * s.head_dim)
        mlp = getattr(layer, n.ffns[0])
        if type(mlp) is not GatedMLP or not isinstance(mlp.gated, GatedLinear) or \
                mlp.down_multiplier != 1.0 or mlp.gated.fused_activation or \
                mlp.act_name not in _ACTIVATIONS:
            raise Unfit(f"{where}'s MLP is not a gated SiLU / GELU-tanh one")
        rotary = attn.rotary
        if rotary is not None and (type(rotary) is not Rotary or not rotary.native_ops):
            raise Unfit(f"{where}'s RoPE is not the half-split one on the C ops")
        norms = {name: _norm(getattr(layer, name) if name else None, f"{where}'s {name}")
                 for name in (n.mixer_norm, n.post_mixer_norm, n.ffn_norm, n.post_ffn_norm)}
        main = [v for v in norms.values() if v is not None]
        in_norm, ffn_norm = norms.get(n.mixer_norm), norms.get(n.ffn_norm)
        if in_norm is None or ffn_norm is None or len({kind[1:] for kind in main}) != 1:
            raise Unfit(f"{where}'s norms differ in kind")
        post_mixer, post_ffn = norms.get(n.post_mixer_norm), norms.get(n.post_ffn_norm)
        qk = [_norm(attn.q_norm, f"{where}'s q norm"), _norm(attn.k_norm, f"{where}'s k norm")]
        qk_kinds = {kind[1:] for kind in qk if kind is not None}
        if len(qk_kinds) > 1:
            raise Unfit(f"{where}'s q and k norms differ in kind")
        qk_offset, qk_eps = qk_kinds.pop() if qk_kinds else (0.0, 0.0)
        gate_up = _matrices(mlp.gated.gate_up if hasattr(mlp.gated, "gate_up") else None,
                            f"{where}'s gate/up", hidden)
        intermediate = sum(m.rows for m in gate_up) // 2
        down = _matrices(mlp.down, f"{where}'s down", intermediate)
        if len(o) != 1 or len(down) != 1:
            raise Unfit(f"{where}'s o_proj or down mixes block types")
        rope = -1
        if rotary is not None:
            keys = [r.key for r in self.rotaries]
            rope = keys.index(rotary.key) if rotary.key in keys else len(keys)
            if rope == len(keys):
                self.rotaries.append(rotary)
        _, offset, eps = main[0]
        layer_struct = Layer(
            in_norm[0], post_mixer[0] if post_mixer else None,
            ffn_norm[0], post_ffn[0] if post_ffn else None,
            qk[0][0] if qk[0] else None, qk[1][0] if qk[1] else None,
            offset, eps, qk_offset, qk_eps,
            (Matrix * MAX_PARTS)(*qkv), len(qkv), o[0], (Matrix * MAX_PARTS)(*gate_up),
            len(gate_up), down[0], s.num_heads, s.num_kv_heads, s.head_dim, intermediate,
            _ACTIVATIONS[mlp.act_name], rope, rotary.rotary_dim if rotary else 0,
            attn.params.scale, attn.params.softcap or 0.0, attn.params.sliding_window or 0,
            None, (_I64 * 5)(), -1)
        self.names.append(attn.name)  # the addresses stay good: the model holds the tensors
        return layer_struct

    def takes(self, h: torch.Tensor, ctx: ForwardContext) -> bool:
        """Whether this step runs here: every token a decode of its own request, at most
        `max_rows` of them, float32 K/V pages and the C attention backend."""
        m = h.shape[0]
        if not quant_linear.FLOAT_ACTIVATIONS and not self.int8_ready:
            return False  # 8-bit activations on some matrices, float on others
        if not (self.refused is None and 0 < m <= self.max_rows and h.dim() == 2
                and h.dtype == torch.float32 and h.device.type == "cpu"
                and isinstance(ctx.backend, CPUPagedBackend)
                and ctx.kv_shared_ctx is None):
            return False
        for meta in ctx.metadata:
            if not isinstance(meta, AttentionMetadata):
                return False
            if meta.query_start_loc[-1] != m or meta.cache_dtype is not None or \
                    meta.key_groups:
                return False
            # Several tokens of a request: a verification step (its drafts after its last
            # token, every row sampled) runs here too; a prompt chunk, whose rows are cut
            # before the last layers, takes the operator path.
            if len(meta.seq_lens) != m and ctx.sampled_ctx is not None:
                return False
        return True

    def _step(self, ctx: ForwardContext) -> _Step | None:
        keep: list[torch.Tensor] = []
        groups = (Group * len(ctx.metadata))()
        for g, meta in enumerate(ctx.metadata):
            table = meta.block_table
            if table.dtype != torch.int64 or table.stride(-1) != 1:
                table = table.to(torch.int64).contiguous()
            slots = meta.slot_mapping
            if slots.dtype != torch.int64 or not slots.is_contiguous():
                slots = slots.to(torch.int64).contiguous()
            rows = meta.short_rows(max_query(meta))
            starts, lens = meta.host_lens
            keep += [table, slots, rows, starts, lens]
            groups[g] = Group(table.data_ptr(), slots.data_ptr(), rows.data_ptr(),
                              starts.data_ptr(), lens.data_ptr(), table.stride(0),
                              rows.numel(), meta.block_size, meta.kernel_block_size,
                              meta.blocks_per_page)
        for i, name in enumerate(self.names):
            cache = ctx.kv_caches[name]
            group = ctx.layer_group[name]
            if cache.data_ptr() != self.cache_ptrs[i] or group != self.group_of[i]:
                if (cache.dim() != 6 or cache.dtype != torch.float32
                        or cache.stride(5) != 1 or cache.device.type != "cpu"):
                    # Not the pages the C kernels read: layer by layer from now on.
                    self.refused = f"{name}'s KV pages are not float32 [pages, per_page, 2, " \
                        f"block, Hk, D] rows"
                    logger.info("decode steps run layer by layer: %s", self.refused)
                    return None
                layer = self.layers[i]
                layer.cache = cache.data_ptr()
                for j in range(5):
                    layer.cs[j] = cache.stride(j)
                layer.group = group
                self.cache_ptrs[i], self.group_of[i] = cache.data_ptr(), group
        return _Step(groups, keep)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor | None:
        """The layers' output for a step `takes` accepted (h [m, hidden] is not changed);
        None where the KV pages turn out not to be the kind the kernels read."""
        step = self._step(ctx)
        if step is None:
            return None
        m = h.shape[0]
        cos_ptrs = (_PTR * max(1, len(self.rotaries)))()
        sin_ptrs = (_PTR * max(1, len(self.rotaries)))()
        for j, rotary in enumerate(self.rotaries):
            cos, sin = rotary.cos_sin(positions, ctx)
            cos = cos.reshape(m, rotary.rotary_dim).contiguous()
            sin = sin.reshape(m, rotary.rotary_dim).contiguous()
            step.keep += [cos, sin]
            cos_ptrs[j], sin_ptrs[j] = cos.data_ptr(), sin.data_ptr()
        out = h.contiguous().clone()
        self.kernels.matmul = self.matmuls[quant_linear.FLOAT_ACTIVATIONS]
        rc = self._run(self.layers, len(self.names), step.groups, ctypes.byref(self.kernels),
                       cos_ptrs, sin_ptrs, out.data_ptr(), m, self.hidden,
                       self.scratch.data_ptr(), torch.get_num_threads())
        if rc != 0:
            what = {2: "a quantized product could not allocate its buffers",
                    3: "the quantized product refused a matrix",
                    4: "the attention kernel refused its arguments"}.get(rc, "unknown")
            raise RuntimeError(f"the native decode layers failed (code {rc}): {what}")
        return out


_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = native.load("decode_layers")
        lib.hkv_decode_scratch.argtypes = [_PTR, _I64, _I64, _I64]
        lib.hkv_decode_scratch.restype = _I64
        lib.hkv_decode_layers.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64,
                                          _I64, _PTR, _I64]
        lib.hkv_decode_layers.restype = ctypes.c_int
        _lib = lib
    return _lib


def attach(model: nn.Module) -> str | None:
    """Give `model` its native decode layers (`model.native_decode`); the reason it cannot
    have them otherwise (one line)."""
    try:
        model.native_decode = NativeDecode(model)  # type: ignore[assignment]
    except (Unfit, native.NativeBuildError) as exc:
        model.native_decode = None  # type: ignore[assignment]
        return str(exc)
    return None
