"""A decode step's decoder layers in one C call (worker/native/decode_layers.c).

At batch 1 a small quantized model's layers are mostly overhead: Gemma 3 270M's 18 layers
run ~25 operators each (norms, projections, RoPE, the K/V write, attention, activation,
residual adds), each a Python call, a torch dispatch and an allocation, ~6-7 ms of a
~30 ms step. `NativeDecode` describes the layers once, at load, as the C side's structs
(norm weights, quantized matrices, attention shape, KV pages), and runs a step in which
every token is a decode through them in one call, with the same kernels the operator path
calls, the gated activation included (so the same bytes: worker/native/quant_gemm.c gives a
row the same result in any batch).

It takes the common layer: pre-norm attention with optional q/k norms, RoPE, an output gate
(Qwen3-Next, Qwen3.5) and Gemma's sandwich norms, then a gated SiLU / GELU-tanh MLP, every
projection GGUF-quantized without bias, float32 K/V pages and the C attention backend; and
in hybrids the state layers of Qwen3.5 (Gated DeltaNet with its projections apart, as its
files hold them) and LFM2 (short convolutions), their float32 states stepped by the C calls
the operator path makes for single-token steps (worker/cpu_ops.py). On the Qwen3.5-0.8B
shape that was ~20 ms of a ~73 ms step. `attach` says in one line why a model does not
fit; a step that does not fit (prefill tokens, more rows than `max_rows`, quantized K/V, a
state to restore or a checkpoint to save) takes the operator path.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.formats.gguf_weights import PermutedInput
from hybridkv.models.layers.attention import Attention
from hybridkv.models.layers.decoder_layer import DecoderLayer
from hybridkv.models.layers.gated_deltanet import GatedDeltaNet
from hybridkv.models.layers.gated_deltanet_split import SplitGatedDeltaNet
from hybridkv.models.layers.mlp import GatedMLP
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.layers.rotary import Rotary
from hybridkv.models.layers.short_conv import ShortConv
from hybridkv.worker import cpu_ops, native
from hybridkv.worker.attention.backend import AttentionMetadata
from hybridkv.worker.attention.cpu import CPUPagedBackend, max_query
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.linear import quant as quant_linear
from hybridkv.worker.linear.layers import GatedLinear, Linear
from hybridkv.worker.linear.quantized import QuantizedLinear, QuantizedParts
from hybridkv.worker.state import StateMetadata

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
                ("cs", _I64 * 5), ("group", _I64),
                ("mixer", _I64), ("q_gate", _I64),
                ("in_", Matrix * 4), ("n_in", _I64), ("o_cols", _PTR),
                ("conv_w", _PTR), ("conv_b", _PTR), ("kernel", _I64),
                ("dt_bias", _PTR), ("a_neg", _PTR), ("head_norm", _PTR),
                ("beta_scale", _F32), ("head_eps", _F32),
                ("k_heads", _I64), ("v_heads", _I64), ("k_dim", _I64), ("v_dim", _I64),
                ("conv_states", _PTR), ("ssm_states", _PTR), ("conv_at", _PTR),
                ("ssm_at", _PTR)]


ATTENTION, DELTANET, SHORT_CONV = 0, 1, 2  # Layer.mixer


class Group(ctypes.Structure):
    _fields_ = [("block_table", _PTR), ("slot_mapping", _PTR), ("rows", _PTR),
                ("query_start_loc", _PTR), ("seq_lens", _PTR), ("table_stride", _I64),
                ("num_rows", _I64), ("block_size", _I64), ("kernel_block_size", _I64),
                ("blocks_per_page", _I64)]


class Kernels(ctypes.Structure):
    _fields_ = [("rms_norm", _PTR), ("rope", _PTR), ("write_kv", _PTR), ("attention", _PTR),
                ("matmul", _PTR), ("gdn_gates", _PTR), ("gdn_decode", _PTR),
                ("gated_head_norm", _PTR), ("sigmoid_gate", _PTR), ("short_conv", _PTR)]


class Unfit(ValueError):
    """Why a model's layers cannot run as one call (one line)."""


def _address(fn: Any) -> int:
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


def _matrices(linear: Any, what: str, cols: int, ordered: bool = False) -> list[Matrix]:
    """The C structs of a projection's quantized parts; `ordered`: parts may carry a row
    order (the C side orders q/k/v and state in-projection outputs only)."""
    if isinstance(linear, QuantizedLinear):
        parts: Any = QuantizedParts([linear])
    else:
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
        self.kinds: list[int] = []  # Layer.mixer of each layer
        self.keep: list[torch.Tensor] = []  # float copies the structs point into
        self.rotaries: list[Rotary] = []
        structs = []
        for i, layer in enumerate(layers):
            structs.append(self._describe(i, layer))
        self.layers = (Layer * len(structs))(*structs)
        # Whether every matrix takes 8-bit activations where they are on (the C call then
        # runs quant.c's kernel on all of them, as the operator path does).
        self.int8_ready = all(
            quant_linear.int8_capable(mat.type)
            for L in structs for mat in (*L.qkv[:L.n_qkv], *L.in_[:L.n_in], L.o,
                                         *L.gate_up[:L.n_gate_up], L.down))
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
        self.kernels.gdn_gates = _address(ops.hkv_gdn_gates_f32)
        self.kernels.gdn_decode = _address(ops.hkv_gdn_decode_f32)
        self.kernels.gated_head_norm = _address(ops.hkv_gated_head_norm_f32)
        self.kernels.sigmoid_gate = _address(ops.hkv_sigmoid_gate_f32)
        self.kernels.short_conv = _address(ops.hkv_short_conv_decode_f32)
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
        mixer = getattr(layer, n.mixer) if n.mixer is not None else None
        if len(n.ffns) != 1:
            raise Unfit(f"{where} is not a mixer then one MLP")
        if type(mixer) is not Attention:
            state = self._state_mixer(where, mixer)
            mlp = self._mlp(where, layer, n)
            norms = self._norms(where, layer, n)
            return self._layer(norms, None, mlp, state=state)
        attn = mixer
        s = attn.shape
        if (attn.reads_shared_kv or attn.keys_only or attn.sinks is not None
                or (s.output_gate and not attn.native_ops)
                or s.key_multiplier != 1.0 or s.value_norm or not (attn.has_k and attn.has_v)
                or attn.params.chunk_size or attn.params.derive_kv is not None
                or attn.kv_deriver is not None):
            raise Unfit(f"{where}'s attention has a variant the C sequence lacks")
        hidden = s.hidden_size
        qkv = _matrices(attn.qkv, f"{where}'s q/k/v", hidden, ordered=True)
        o = _matrices(attn.o_proj, f"{where}'s o_proj", s.num_heads * s.head_dim)
        if len(o) != 1:
            raise Unfit(f"{where}'s o_proj mixes block types")
        mlp = self._mlp(where, layer, n)
        norms = self._norms(where, layer, n)
        rotary = attn.rotary
        if rotary is not None and (type(rotary) is not Rotary or not rotary.native_ops):
            raise Unfit(f"{where}'s RoPE is not the half-split one on the C ops")
        qk = [_norm(attn.q_norm, f"{where}'s q norm"), _norm(attn.k_norm, f"{where}'s k norm")]
        qk_kinds = {kind[1:] for kind in qk if kind is not None}
        if len(qk_kinds) > 1:
            raise Unfit(f"{where}'s q and k norms differ in kind")
        qk_offset, qk_eps = qk_kinds.pop() if qk_kinds else (0.0, 0.0)
        rope = -1
        if rotary is not None:
            keys = [r.key for r in self.rotaries]
            rope = keys.index(rotary.key) if rotary.key in keys else len(keys)
            if rope == len(keys):
                self.rotaries.append(rotary)
        layer_struct = self._layer(norms, o[0], mlp)
        layer_struct.q_norm = qk[0][0] if qk[0] else None
        layer_struct.k_norm = qk[1][0] if qk[1] else None
        layer_struct.qk_offset, layer_struct.qk_eps = qk_offset, qk_eps
        layer_struct.qkv = (Matrix * MAX_PARTS)(*qkv)
        layer_struct.n_qkv = len(qkv)
        layer_struct.heads, layer_struct.kv_heads = s.num_heads, s.num_kv_heads
        layer_struct.head_dim = s.head_dim
        layer_struct.rope, layer_struct.rotary_dim = rope, rotary.rotary_dim if rotary else 0
        layer_struct.scale = attn.params.scale
        layer_struct.softcap = attn.params.softcap or 0.0
        layer_struct.window = attn.params.sliding_window or 0
        layer_struct.mixer, layer_struct.q_gate = ATTENTION, int(s.output_gate)
        self.names.append(attn.name)  # the addresses stay good: the model holds the tensors
        self.kinds.append(ATTENTION)
        return layer_struct

    def _mlp(self, where: str, layer: Any, n: Any) -> tuple[list[Matrix], Matrix, int, int]:
        """(gate/up parts, down, intermediate size, activation) of a layer's gated MLP."""
        mlp = getattr(layer, n.ffns[0])
        if type(mlp) is not GatedMLP or not isinstance(mlp.gated, GatedLinear) or \
                mlp.down_multiplier != 1.0 or mlp.gated.fused_activation or \
                mlp.act_name not in _ACTIVATIONS:
            raise Unfit(f"{where}'s MLP is not a gated SiLU / GELU-tanh one")
        gate_up = _matrices(mlp.gated.gate_up if hasattr(mlp.gated, "gate_up") else None,
                            f"{where}'s gate/up", self.hidden)
        intermediate = sum(m.rows for m in gate_up) // 2
        down = _matrices(mlp.down, f"{where}'s down", intermediate)
        if len(down) != 1:
            raise Unfit(f"{where}'s down mixes block types")
        return gate_up, down[0], intermediate, _ACTIVATIONS[mlp.act_name]

    def _norms(self, where: str, layer: Any, n: Any) -> list[Any]:
        """(input, post-mixer, pre-FFN, post-FFN) norms as (address, offset, eps) or None,
        the input and pre-FFN ones present, all of one kind."""
        norms = [_norm(getattr(layer, name) if name else None, f"{where}'s {name}")
                 for name in (n.mixer_norm, n.post_mixer_norm, n.ffn_norm, n.post_ffn_norm)]
        main = [v for v in norms if v is not None]
        if norms[0] is None or norms[2] is None or len({kind[1:] for kind in main}) != 1:
            raise Unfit(f"{where}'s norms differ in kind")
        return norms

    def _layer(self, norms: list[Any], o: Matrix | None,
               mlp: tuple[list[Matrix], Matrix, int, int], state: Layer | None = None) -> Layer:
        """The Layer struct with what every kind of layer has (norms, the MLP) filled in on
        `state` (a state mixer's, from _state_mixer) or a new one with `o` its o_proj."""
        gate_up, down, intermediate, act = mlp
        L = state if state is not None else Layer()
        in_norm, post_mixer, ffn_norm, post_ffn = norms
        L.in_norm, L.pre_ffn_norm = in_norm[0], ffn_norm[0]
        L.post_attn_norm = post_mixer[0] if post_mixer else None
        L.post_ffn_norm = post_ffn[0] if post_ffn else None
        L.norm_offset, L.eps = in_norm[1], in_norm[2]
        if o is not None:
            L.o = o
        L.gate_up = (Matrix * MAX_PARTS)(*gate_up)
        L.n_gate_up, L.down, L.intermediate, L.act = len(gate_up), down, intermediate, act
        L.group, L.rope = -1, -1
        return L

    def _state_mixer(self, where: str, mixer: Any) -> Layer:
        """A Gated DeltaNet (q|k|v, z, b, a projections apart, as Qwen3.5's files hold
        them) or LFM2 short conv, as a Layer struct of its mixer's fields."""
        keep = self.keep
        L = Layer()
        hidden = self.hidden
        if type(mixer) is ShortConv:
            if not mixer.native_ops:
                raise Unfit(f"{where}'s short conv is not on the C ops")
            ins = _matrices(mixer.in_proj, f"{where}'s in_proj", hidden, ordered=True)
            o, o_cols = self._out_proj(where, mixer.out_proj, hidden)
            L.mixer, L.in_[0], L.n_in = SHORT_CONV, ins[0], 1
            if len(ins) != 1 or mixer.in_proj.out_features != 3 * hidden:
                raise Unfit(f"{where}'s in_proj is not one [3 hidden, hidden] matrix")
            channels = hidden
        elif isinstance(mixer, SplitGatedDeltaNet) and type(mixer).forward is \
                GatedDeltaNet.forward:
            if not mixer.native_ops or mixer.act is not nn.functional.silu or \
                    mixer.conv1d.bias is not None:
                raise Unfit(f"{where}'s Gated DeltaNet is not a silu one on the C ops")
            parts = []
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
                part = _matrices(getattr(mixer, name), f"{where}'s {name}", hidden, ordered=True)
                if len(part) != 1:
                    raise Unfit(f"{where}'s {name} mixes block types")
                parts += part
            o, o_cols = self._out_proj(where, mixer.out_proj, mixer.value_size)
            L.mixer, L.n_in = DELTANET, 4
            L.in_ = (Matrix * 4)(*parts)
            a_neg = (-mixer.A_log.detach().float().exp()).contiguous()
            dt_bias = mixer.dt_bias.detach().float().contiguous()
            norm = mixer.norm.weight.detach().float().contiguous()
            keep += [a_neg, dt_bias, norm]
            L.a_neg, L.dt_bias, L.head_norm = a_neg.data_ptr(), dt_bias.data_ptr(), \
                norm.data_ptr()
            L.beta_scale, L.head_eps = mixer.beta_scale, mixer.eps
            L.k_heads, L.v_heads = mixer.num_k_heads, mixer.num_v_heads
            L.k_dim, L.v_dim = mixer.k_dim, mixer.v_dim
            channels = 2 * mixer.key_size + mixer.value_size
        else:
            raise Unfit(f"{where}'s mixer is {type(mixer).__name__}, which the C sequence "
                        f"lacks (it takes attention, Qwen3.5's split Gated DeltaNet and "
                        f"LFM2's short conv)")
        conv = mixer.conv if type(mixer) is ShortConv else mixer.conv1d
        weight = conv.weight.detach().float().reshape(channels, -1).contiguous()
        bias = None if conv.bias is None else conv.bias.detach().float().contiguous()
        keep += [weight] + ([bias] if bias is not None else [])
        L.conv_w, L.conv_b = weight.data_ptr(), None if bias is None else bias.data_ptr()
        L.kernel = weight.shape[1]
        L.o = o
        if o_cols is not None:
            keep.append(o_cols)
            L.o_cols = o_cols.data_ptr()
        self.names.append(mixer.name)
        self.kinds.append(int(L.mixer))
        return L

    def _out_proj(self, where: str, linear: Any, cols: int) -> tuple[Matrix, Any]:
        """A state mixer's out-projection and the input column each of its columns reads
        (None: in order)."""
        columns = None
        if isinstance(linear, PermutedInput):
            columns = linear.columns.to(torch.int64).contiguous()
            linear = linear.linear
        o = _matrices(linear, f"{where}'s out_proj", cols)
        if len(o) != 1:
            raise Unfit(f"{where}'s out_proj mixes block types")
        return o[0], columns

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
            if isinstance(meta, StateMetadata):
                # State layers: every request one token from its own state, nothing to
                # restore or save (a prompt's, a restore's or a checkpoint's step runs the
                # operator path).
                if meta.query_start_loc[-1] != m or len(meta.plain_steps) != m:
                    return False
                continue
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
            if isinstance(meta, StateMetadata):
                continue  # state layers' places: _bind_states
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
        places: dict[tuple[int, int, int], torch.Tensor] = {}
        for i, name in enumerate(self.names):
            if self.kinds[i] != ATTENTION:
                if not self._bind_states(i, name, ctx, places, keep):
                    return None
                continue
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

    def _bind_states(self, i: int, name: str, ctx: ForwardContext,
                     places: dict[tuple[int, int, int], torch.Tensor],
                     keep: list[torch.Tensor]) -> bool:
        """Point state layer i at its states and this step's rows' offsets in them (False,
        and the layers run one by one from now on, where the states are not the kind the C
        steps take)."""
        meta, states = ctx.state(name)
        layer = self.layers[i]
        if self.kinds[i] == DELTANET:
            conv, ssm = states
            fits = cpu_ops.decode_states_take(conv, ssm)
        else:
            (conv,), ssm = states, None
            fits = cpu_ops.conv_states_take(conv)
        if not fits:
            self.refused = f"{name}'s states are not float32 [pages, slots, ...] rows"
            logger.info("decode steps run layer by layer: %s", self.refused)
            return False
        rows = meta.plain_steps
        for tensor, field in ((conv, "conv"), (ssm, "ssm")):
            if tensor is None:
                continue
            key = (id(meta), tensor.stride(0), tensor.stride(1))
            at = places.get(key)
            if at is None:
                at = places[key] = torch.tensor(
                    [meta.state_pages[r] * key[1] + meta.state_slots[r] * key[2]
                     for r in rows], dtype=torch.int64)
                keep.append(at)
            setattr(layer, f"{field}_at", at.data_ptr())
            setattr(layer, f"{field}_states", tensor.data_ptr())
        return True

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
