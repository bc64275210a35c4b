"""A GGUF file's tensors into a model built from its config, weights kept in their blocks.

Names: the model's parameters carry Hugging Face names; the `gguf` package's tensor-name map
(llama.cpp's own table, per architecture) turns each into the file's name
(`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`), so every family the
table covers needs no table here.

What stays quantized: the weight of every linear layer (any GGML type the kernels compute on,
F32/F16/BF16 included), the embedding table, which a tied LM head shares, and stacked experts
(Gemma 4's 3-D ffn_gate_up_exps / ffn_down_exps: one quantized matrix per expert in a
QuantizedStackedExperts, formats/quantized_experts.py). Norms, biases
and other small tensors are dequantized to float32. A matrix of a type the kernels lack is
refused in one line naming it, unless `dequantize=True` asks for float32 weights (the
choice on CUDA, where the model then runs as any float32 checkpoint does).

The converter's two rewrites are undone: llama-architecture q/k rows are in another order
(its RoPE pairs neighbours, Hugging Face's pairs halves; quantization blocks run along rows,
so whole rows move): a quantized q/k matrix stays as the file holds it and its product's
columns are put back in order (`QuantizedWeight.row_order`: a copy of the matrix would be
memory of this process's own, ~108 MiB on SmolLM2-1.7B), float ones are permuted at load;
and Gemma's norm weights lose the 1 the converter added.

Per-architecture fixups (`_FIXUPS`): parameter renames onto the names llama.cpp's table knows
(Mamba's `backbone.`, Mamba-2's dt_bias), fused tensors split along their first dimension
(qwen2moe/qwen3moe's 3-D `ffn_{gate,up,down}_exps` [experts, rows, cols] into one quantized
matrix per expert; router `ffn_gate_inp` and shared experts `ffn_*_shexp` map by name), and
float transforms by tensor-name suffix (Mamba's `ssm_a` = -exp(A_log) back to A_log, Mamba-2's
per-group `ssm_norm`); shapes that differ only by dimensions of 1 (squeezed conv1d weights,
Mamba-2's [heads, 1] A and D, Qwen's vector `ffn_gate_inp_shexp`) are reshaped. The reverse
of a split: a parameter the converter cut into several tensors (Granite's fused gate|up into
`ffn_gate_*` and `ffn_up_*`) is joined back along its rows, bytes as they are where the types
agree (each row is quantized on its own), else as float32. Rows the converter reordered
(Qwen3.5's DeltaNet value heads, grouped -> tiled) move back as they are; columns it reordered
stay, and the layer gathers its input into the file's order (`PermutedInput`).

Gemma 3n's AltUp projections are slices of one stacked tensor each (as experts are); names
llama.cpp's table lacks (Gemma 4's router `.scale` tensors) are given per architecture.

Tensors of the layers after the model's own (Qwen3.5's `nextn` multi-token-prediction block)
are not loaded: they are listed on the model (`mtp_tensors`, their names, types and offsets in
the file) for a speculative-decoding head to read.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.formats.gguf_config import ARCHS
from hybridkv.models.formats.gguf_file import GGUFHeader, TensorInfo
from hybridkv.models.formats.quantized_experts import QuantizedStackedExperts
from hybridkv.models.registry import build_model
from hybridkv.models.weights import no_init
from hybridkv.worker.linear import quant as quant_linear
from hybridkv.worker.linear.quant import QuantizedWeight
from hybridkv.worker.linear.quantized import QuantizedEmbedding, QuantizedLinear

# Tensors llama.cpp files may carry that the engine computes itself.
_DERIVED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


Transform = Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]


def _a_log(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The file keeps Mamba's A = -exp(A_log); the models keep A_log."""
    return torch.log(-value).reshape(shape)


def _reshape(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return value.reshape(shape)


@dataclass(frozen=True)
class _Fixups:
    """What one architecture's converter did beyond renaming, undone here."""

    # (regex, replacement) turning a parameter's name into the Hugging Face name llama.cpp's
    # table knows. Parameters that land on one file tensor are its slices along the first
    # dimension, in module order: per-expert matrices of a 3-D `ffn_*_exps` tensor
    # [experts, rows, cols] (each expert's rows are contiguous bytes, so each becomes its own
    # quantized matrix), or q/k/v of a fused `attn_qkv`.
    renames: tuple[tuple[str, str], ...] = ()
    # File tensor-name suffix -> transform of its float32 value into the parameter's shape
    # (shapes that differ only by dimensions of 1 need none).
    transforms: tuple[tuple[str, Transform], ...] = ()
    # Parameters the converter split into several file tensors (Granite's fused gate|up
    # `input_linear` into ffn_gate* and ffn_up*): (regex on the parameter's name, the file
    # tensors' names as templates of its groups), joined back along their rows (dim -2).
    joins: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # (file tensor name, config) -> the file's row for each of the parameter's rows (the
    # converter moved whole rows: each row is quantized on its own, so bytes move as they
    # are), or None.
    rows: Callable[[str, dict[str, Any]], np.ndarray | None] = lambda name, cfg: None
    # The same for the columns of a matrix: a quantized matrix keeps its columns as stored
    # and reads its input in the file's order instead (PermutedInput).
    columns: Callable[[str, dict[str, Any]], np.ndarray | None] = lambda name, cfg: None
    # (regex on the parameter's name, file tensor name as a template of its groups) for
    # tensors llama.cpp's table has no entry for (it writes them by hand).
    names: tuple[tuple[str, str], ...] = ()


def _tiled_to_grouped(num_k_heads: int, num_v_heads: int, head_dim: int) -> np.ndarray:
    """Index of the file's row for each Hugging Face row of a value-head dimension.

    Qwen3.5's converter reorders the DeltaNet's value heads from grouped by key head to
    tiled, for ggml's broadcast: E.g. 2 key heads, 4 value heads (v0 v1 | v2 v3 grouped,
    key head 0 then 1) -> file order v0 v2 v1 v3."""
    per_k = num_v_heads // num_k_heads
    # file position of (key head k, its value head r, element d) is (r, k, d)
    return np.arange(num_v_heads * head_dim).reshape(per_k, num_k_heads, head_dim).transpose(
        1, 0, 2).reshape(-1)


def _qwen3_5_heads(cfg: dict[str, Any]) -> tuple[int, int, int, int] | None:
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if nk == nv:
        return None
    return nk, nv, int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])


def _qwen3_5_rows(name: str, cfg: dict[str, Any]) -> np.ndarray | None:
    """attn_qkv's and ssm_conv1d's value rows (after q and k), attn_gate's rows, one row per
    value head of ssm_alpha / ssm_beta / ssm_a / ssm_dt."""
    heads = _qwen3_5_heads(cfg)
    if heads is None or not name.startswith("blk."):
        return None
    nk, nv, dk, dv = heads
    if name.endswith(("attn_qkv.weight", "ssm_conv1d.weight")):
        qk = 2 * nk * dk
        return np.concatenate([np.arange(qk), qk + _tiled_to_grouped(nk, nv, dv)])
    if name.endswith("attn_gate.weight"):
        return _tiled_to_grouped(nk, nv, dv)
    if name.endswith(("ssm_alpha.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias")):
        return _tiled_to_grouped(nk, nv, 1)
    return None


def _qwen3_next_rows(name: str, cfg: dict[str, Any]) -> np.ndarray | None:
    """in_proj_qkvz joined back from the converter's attn_qkv ([all q | all k | all v]) and
    attn_gate (all z) into Hugging Face's order, per key head [q | k | its v heads | their
    z]."""
    if ".attn_qkv.weight+" not in name:  # the joined tensor's name
        return None
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    q, v, per_k = nk * dk, nv * dv, nv // nk * dv
    return np.concatenate([np.concatenate([
        h * dk + np.arange(dk), q + h * dk + np.arange(dk),
        2 * q + h * per_k + np.arange(per_k), 2 * q + v + h * per_k + np.arange(per_k)])
        for h in range(nk)])


def _qwen3_5_columns(name: str, cfg: dict[str, Any]) -> np.ndarray | None:
    heads = _qwen3_5_heads(cfg)
    if heads is None or not name.endswith("ssm_out.weight"):
        return None
    nk, nv, _, dv = heads
    return _tiled_to_grouped(nk, nv, dv)


_EXPERTS = (r"\.experts\.\d+\.", ".experts.")
_MAMBA = (r"^model\.", "backbone.")
_MAMBA2 = _Fixups(renames=(_MAMBA, (r"\.mixer\.dt_bias$", ".mixer.dt_proj.bias")),
                  transforms=(("ssm_a", _a_log), ("ssm_norm.weight", _reshape)))
_FIXUPS: dict[str, _Fixups] = {
    "qwen2moe": _Fixups(renames=(_EXPERTS,)),
    "qwen3moe": _Fixups(renames=(_EXPERTS,)),
    # A transform also keeps a linear weight float32: the Mamba-1 mixer reads dt_proj's
    # matrix directly.
    "mamba": _Fixups(renames=(_MAMBA,), transforms=(("ssm_a", _a_log),
                                                    ("ssm_dt.weight", _reshape))),
    # Mamba-2: A and D per head as [heads, 1], the gated norm per group [groups, width / groups],
    # dt_bias stored as the dt projection's bias.
    "mamba2": _MAMBA2,
    # NemotronH: Mamba-2 mixers as mamba2's; attention and relu² MLP layers by name.
    "nemotron_h": _MAMBA2,
    # Phi-3: q/k/v are the row slices of the fused attn_qkv, in that order.
    "phi3": _Fixups(renames=((r"\.self_attn\.[qkv]_proj\.", ".self_attn.qkv_proj."),)),
    # Falcon-H1: its µP multipliers are folded into the weights by the converter.
    "falcon-h1": _Fixups(renames=((r"\.mamba\.dt_bias$", ".mamba.dt_proj.bias"),),
                         transforms=_MAMBA2.transforms),
    # Jamba: Mamba-1 mixers (dt_proj's matrix read directly: float32), experts as qwen's.
    "jamba": _Fixups(renames=(_EXPERTS,), transforms=(("ssm_a", _a_log),
                                                      ("ssm_dt.weight", _reshape))),
    # Qwen3.5: DeltaNet value heads back from tiled to grouped order; A and dt_bias as
    # Mamba-2's (conv1d squeezed).
    "qwen35": (_QWEN3_5 := _Fixups(
        renames=((r"\.linear_attn\.dt_bias$", ".linear_attn.dt_proj.bias"),),
        transforms=(("ssm_a", _a_log),), rows=_qwen3_5_rows, columns=_qwen3_5_columns)),
    # Qwen3-Next: in_proj_qkvz was split into attn_qkv and attn_gate, reordered.
    "qwen3next": _Fixups(
        renames=(*_QWEN3_5.renames, _EXPERTS), transforms=_QWEN3_5.transforms,
        joins=((r"^model\.layers\.(\d+)\.linear_attn\.in_proj_qkvz\.weight$",
                ("blk.{0}.attn_qkv.weight", "blk.{0}.attn_gate.weight")),),
        rows=_qwen3_next_rows),
    "qwen35moe": _Fixups(renames=(*_QWEN3_5.renames, _EXPERTS), transforms=_QWEN3_5.transforms,
                         rows=_qwen3_5_rows, columns=_qwen3_5_columns),
    # LFM2-MoE: experts as qwen's; the routing bias written as a bias (exp_probs_b.bias).
    "lfm2moe": _Fixups(renames=(_EXPERTS, (r"\.expert_bias$", ".expert_bias.bias"))),
    # Granite 4.0-H: the fused gate|up projections were split into ffn_gate*/ffn_up*.
    # Gemma 3n: the AltUp projections stacked into one tensor each ([copies, hidden, hidden],
    # one slice per copy); AltUp's output scale written as a weight.
    "gemma3n": _Fixups(renames=(
        (r"^model\.altup_projections\.\d+\.weight$", "model.altup_projections.weight"),
        (r"^model\.altup_unembed_projections\.\d+\.weight$",
         "model.altup_unembed_projections.weight"),
        (r"\.altup\.correct_output_scale$", ".altup.correct_output_scale.weight"))),
    # Gemma 4: the layer scalar and the stacked experts written as weights; the router's
    # input scale and per-expert output scale as `.scale` tensors beside the router and the
    # experts' down projection.
    "gemma4": _Fixups(
        renames=((r"\.layer_scalar$", ".layer_scalar.weight"),
                 (r"\.experts\.(gate_up_proj|down_proj)$", r".experts.\1.weight")),
        names=((r"^model\.layers\.(\d+)\.router\.scale$", "blk.{0}.ffn_gate_inp.scale"),
               (r"^model\.layers\.(\d+)\.router\.per_expert_scale$",
                "blk.{0}.ffn_down_exps.scale"))),
    "granitehybrid": _Fixups(
        renames=((r"\.mamba\.dt_bias$", ".mamba.dt_proj.bias"),),
        transforms=_MAMBA2.transforms,
        joins=((r"^model\.layers\.(\d+)\.block_sparse_moe\.input_linear\.weight$",
                ("blk.{0}.ffn_gate_exps.weight", "blk.{0}.ffn_up_exps.weight")),
               (r"^model\.layers\.(\d+)\.shared_mlp\.input_linear\.weight$",
                ("blk.{0}.ffn_gate_shexp.weight", "blk.{0}.ffn_up_shexp.weight")))),
}

# The multi-token-prediction head's own tensors at its layer (formats/mtp_weights.py loads
# the head on a view named as that layer), which llama.cpp's table lists for few
# architectures.
_NEXTN = ((r"^model\.layers\.(\d+)\.eh_proj\.weight$", "blk.{0}.nextn.eh_proj.weight"),
          (r"^model\.layers\.(\d+)\.enorm\.weight$", "blk.{0}.nextn.enorm.weight"),
          (r"^model\.layers\.(\d+)\.hnorm\.weight$", "blk.{0}.nextn.hnorm.weight"),
          (r"^model\.layers\.(\d+)\.shared_head\.norm\.weight$",
           "blk.{0}.nextn.shared_head_norm.weight"))
for _arch in ("qwen35", "qwen3next", "qwen35moe"):
    _FIXUPS[_arch] = replace(_FIXUPS[_arch], names=(*_FIXUPS[_arch].names, *_NEXTN))


def gguf_names(model: nn.Module, arch: str, num_layers: int) -> dict[str, list[str]]:
    """GGUF tensor name -> the model's parameter names it holds (one, or the slices of a
    fused tensor in order), for every parameter the table maps."""
    import gguf

    arch_id = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), None)
    if arch_id is None:
        raise ValueError(f"GGUF architecture {arch!r} is unknown to the gguf package")
    table = gguf.get_tensor_name_map(arch_id, num_layers)
    fixups = _FIXUPS.get(arch, _Fixups())
    renames = [(re.compile(p), r) for p, r in fixups.renames]
    direct = [(re.compile(p), template) for p, template in fixups.names]
    names: dict[str, list[str]] = {}
    for param in dict(model.named_parameters(remove_duplicate=False)):
        hf_name = param
        for pattern, repl in renames:
            hf_name = pattern.sub(repl, hf_name)
        gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            gguf_name = next((template.format(*m.groups()) for pattern, template in direct
                              if (m := pattern.search(param)) is not None), None)
        if gguf_name is None:
            continue
        names.setdefault(gguf_name, []).append(param)
        suffix = next((x for x in (".weight", ".bias") if hf_name.endswith(x)), "")
        if not gguf_name.endswith(suffix):
            # Entries written with their suffix (Falcon-H1's pre_ff_layernorm.weight) give
            # the name without it, which llama.cpp's converter writes; the name with it is
            # what llama.cpp loads. Either places the parameter.
            names.setdefault(gguf_name + suffix, []).append(param)
    return names


def joined_names(model: nn.Module, arch: str) -> dict[str, tuple[str, int, int]]:
    """File tensor name -> (parameter, its part, the number of parts) for the parameters
    made of several file tensors."""
    out: dict[str, tuple[str, int, int]] = {}
    joins = [(re.compile(p), parts) for p, parts in _FIXUPS.get(arch, _Fixups()).joins]
    for param in dict(model.named_parameters(remove_duplicate=False)):
        for pattern, parts in joins:
            if (m := pattern.search(param)) is not None:
                for i, part in enumerate(parts):
                    out[part.format(*m.groups())] = (param, i, len(parts))
    return out


def _join(parts: list[tuple[np.ndarray, TensorInfo]]) -> tuple[np.ndarray, TensorInfo]:
    """Row blocks of one parameter as one tensor: their bytes joined where the types agree
    (rows are quantized on their own), else their float32 values."""
    infos = [info for _, info in parts]
    shape = (*infos[0].shape[:-2], sum(i.shape[-2] for i in infos), infos[0].shape[-1])
    if any(i.shape[:-2] != infos[0].shape[:-2] or i.shape[-1] != shape[-1] for i in infos):
        raise ValueError(f"tensors {[i.name for i in infos]} of shapes "
                         f"{[list(i.shape) for i in infos]} do not join along their rows")
    if len({i.qtype for i in infos}) == 1:
        blocks = [raw.reshape(*i.shape[:-1], -1) for raw, i in parts]
        qtype = infos[0].qtype
    else:
        blocks = [_float(raw, i, i.shape).numpy() for raw, i in parts]
        qtype = 0  # F32
    data = np.concatenate(blocks, axis=-2)
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1, data.shape[-1] * (
        data.itemsize))
    return data, TensorInfo("+".join(i.name for i in infos), shape, qtype, 0, data.size)


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, its rows were [pairs of (first half i,
    second half i)]; Hugging Face keeps [first halves, second halves]."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


class _FileTensors:
    """Each tensor's bytes as a view of one private mapping of the file: a weight kept in
    its blocks is used where it lies, so its pages are the page cache's, shared by every
    process (and replica) that maps the file, and read from disk on first use rather than
    copied at load. Private (copy-on-write), so a stray write gets a page of its own instead
    of a crash or a changed file. The mapping lives as long as any view of it (numpy keeps
    it as their base); only what a load must change (dequantized norms, permuted or joined
    rows) is memory of this process's own."""

    def __init__(self, header: GGUFHeader) -> None:
        self.header = header
        with open(header.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        # Read ahead: the first steps then find the weights in memory, not on disk.
        with contextlib.suppress(AttributeError, OSError):
            self._map.madvise(mmap.MADV_WILLNEED)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def raw(self, info: TensorInfo) -> np.ndarray:
        """uint8 [rows, bytes per row] (rows: every dimension but the last)."""
        if info.offset + info.nbytes > self._bytes.size:
            raise ValueError(f"{self.header.path}: tensor {info.name!r} is cut short")
        rows = 1
        for d in info.shape[:-1]:
            rows *= d
        return self._bytes[info.offset:info.offset + info.nbytes].reshape(rows, -1)

    def close(self) -> None:
        """Drop this reader's reference; the views the model keeps hold the mapping."""
        del self._bytes


def _tensor(raw: np.ndarray) -> torch.Tensor:
    """A torch view of a tensor's bytes (rows permuted or joined at load are copies)."""
    return torch.from_numpy(np.ascontiguousarray(raw))


def _quantized(raw: np.ndarray, info: TensorInfo) -> QuantizedWeight:
    data = _tensor(raw)
    return QuantizedWeight(data, info.qtype, data.shape[0], info.shape[-1])


def _float(raw: np.ndarray, info: TensorInfo, shape: tuple[int, ...]) -> torch.Tensor:
    return quant_linear.dequantize(_tensor(raw), info.qtype, info.shape[-1]).reshape(shape)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _slices(header: GGUFHeader, info: TensorInfo, raw: np.ndarray,
            pnames: list[str], params: dict[str, nn.Parameter], transformed: bool
            ) -> Iterator[tuple[str, np.ndarray, tuple[int, ...]]]:
    """(parameter, its rows of the tensor's bytes, their shape as stored) for each parameter
    a file tensor holds: the whole tensor, or consecutive row slices of a fused one."""
    if len(pnames) == 1:
        pshape = tuple(params[pnames[0]].shape)
        fits = pshape == info.shape or _squeezed(pshape) == _squeezed(info.shape) or (
            transformed and int(np.prod(pshape)) == int(np.prod(info.shape)))
        if not fits:
            raise ValueError(f"{header.path}: tensor {info.name!r} has shape "
                             f"{list(info.shape)}, the model expects {list(pshape)}")
        yield pnames[0], raw, info.shape
        return
    shapes = [tuple(params[p].shape) for p in pnames]
    if any(len(s) != 2 or s[1] != info.shape[-1] for s in shapes) \
            or sum(s[0] for s in shapes) != raw.shape[0]:
        raise ValueError(f"{header.path}: tensor {info.name!r} of shape {list(info.shape)} "
                         f"does not split into {', '.join(pnames[:3])}... of shapes "
                         f"{[list(s) for s in shapes[:3]]}...")
    start = 0
    for pname, shape in zip(pnames, shapes, strict=True):
        yield pname, raw[start:start + shape[0]], shape
        start += shape[0]


def _module(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return model.get_submodule(parent), attr


def _reads_other_kv(model: CausalLM, name: str) -> bool:
    """K/V tensors of a layer that reads another layer's KV (released Gemma 3n checkpoints
    carry them, and the converter writes them): left in the file unread, as llama.cpp leaves
    them; the file-name twin of the checkpoint names in CausalLM.unused_weights."""
    return _layer(name) in getattr(getattr(model, "cfg", None), "kv_targets", ()) and \
        name.endswith((".attn_k.weight", ".attn_v.weight", ".attn_k_norm.weight",
                       ".attn_v_norm.weight"))


def _layer(name: str) -> int:
    """The layer of a `blk.N.*` tensor name; -1 for the others."""
    head, _, rest = name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "blk" and index.isdigit() else -1


def load_gguf_weights(model: CausalLM, header: GGUFHeader, config: dict[str, Any], *,
                      dequantize: bool) -> tuple[TensorInfo, ...]:
    """Place the file's tensors in `model`; returns the tensors of the layers after the
    model's own (the `nextn` multi-token-prediction block), left in the file."""
    arch = ARCHS[header.architecture]
    num_layers = int(config["num_hidden_layers"])
    names = gguf_names(model, header.architecture, num_layers)
    mtp: list[TensorInfo] = []
    # Attention-free models (Mamba) carry no head counts; only q/k permutation reads them.
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    files = _FileTensors(header)
    params = dict(model.named_parameters())
    fixups = _FIXUPS.get(header.architecture, _Fixups())
    joined = joined_names(model, header.architecture)
    pending: dict[str, list[Any]] = {}
    loaded: set[str] = set()
    try:
        for info in header.tensors.values():
            if info.name in _DERIVED:
                continue
            if info.name in joined:
                pname, index, count = joined[info.name]
                pending.setdefault(pname, [None] * count)[index] = (files.raw(info), info)
                if any(p is None for p in pending[pname]):
                    continue
                raw, info = _join(pending.pop(pname))
                names[info.name] = [pname]
            elif _layer(info.name) >= num_layers:
                mtp.append(info)  # the nextn block after the model's layers
                continue
            elif info.name not in names:
                if _reads_other_kv(model, info.name):
                    continue
                raise ValueError(f"{header.path}: tensor {info.name!r} has no place in "
                                 f"{config['model_type']}")
            # A tied parameter seen under its other name is skipped.
            pnames = [p for p in names[info.name] if p in params]
            if not pnames:
                continue
            transform = next((fn for suffix, fn in fixups.transforms
                              if info.name.endswith(suffix)), None)
            if "+" not in info.name:  # a joined tensor has its bytes already
                raw = files.raw(info)
            if (order := fixups.rows(info.name, config)) is not None:
                raw = raw.reshape(len(order), -1)[order].reshape(raw.shape)
            row_order = None
            if arch.permuted_qk and info.name.endswith(("attn_q.weight", "attn_k.weight",
                                                        "attn_q.bias", "attn_k.bias")):
                row_order = _unpermute_rows(np.arange(raw.shape[0]),
                                            heads if "attn_q" in info.name else kv_heads)
                if len(pnames) > 1:
                    raw, row_order = raw[row_order], None
            for pname, part, shape in _slices(header, info, raw, pnames, params,
                                              transform is not None):
                _place(header, model, params, pname, part, info, shape, arch, transform,
                       fixups.columns(info.name, config), row_order, dequantize=dequantize)
                loaded.add(pname)
    finally:
        files.close()
    _tie_head(model, config)
    missing = [p for p in dict(model.named_parameters()) if p not in loaded
               and not _in_quantized(model, p)]
    missing += [f"{name}.down_proj / gate_up_proj" for name, m in model.named_modules()
                if isinstance(m, QuantizedStackedExperts) and not m.complete]
    if missing:
        raise ValueError(f"{header.path}: the file lacks {len(missing)} tensor(s) the model "
                         f"needs, e.g. {missing[0]!r}")
    return tuple(mtp)


class PermutedInput(nn.Module):
    """A quantized linear layer whose columns the file stores in another order: its input is
    gathered into that order (`x[..., columns]`), so the blocks stay as they are."""

    def __init__(self, linear: QuantizedLinear, columns: np.ndarray) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("columns", torch.from_numpy(np.argsort(columns)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.columns))


def _place(header: GGUFHeader, model: nn.Module, params: dict[str, nn.Parameter], pname: str,
           raw: np.ndarray, info: TensorInfo, shape: tuple[int, ...], arch: Any,
           transform: Transform | None, columns: np.ndarray | None,
           row_order: np.ndarray | None = None, *, dequantize: bool) -> None:
    """One parameter from its bytes: a linear or embedding weight as a quantized module
    (unless `dequantize`), anything else as float32. `columns`: the file's column for each
    of the parameter's columns; `row_order`: the file's row for each of its rows (a
    quantized linear keeps the file's rows and orders its output; anything else is
    permuted here)."""
    owner, attr = _module(model, pname)
    matrix = attr == "weight" and isinstance(owner, (nn.Linear, nn.Embedding))
    experts = attr in ("gate_up_proj", "down_proj") and (
        isinstance(owner, QuantizedStackedExperts) or QuantizedStackedExperts.takes(owner))
    where = f"{header.path}: tensor {info.name!r}" + (
        f" (for {pname!r})" if shape != info.shape else "")
    quantized = (matrix or experts) and not dequantize and transform is None
    if row_order is not None and not (quantized and isinstance(owner, nn.Linear)):
        raw, row_order = raw[row_order], None
    if quantized:
        if info.qtype not in quant_linear.SUPPORTED:
            raise ValueError(
                f"{where} is {info.type_name}, which the quantized kernels do not "
                f"compute on (supported: {', '.join(quant_linear.SUPPORTED.values())}); pass "
                f"dequantize=True (--dequantize) to load it as float32")
        if experts:
            _place_experts(model, pname, owner, raw, info)
            return
        weight = _quantized(raw, info)
        if row_order is not None:
            weight.row_order = torch.from_numpy(row_order.astype(np.int64))
        parent, child = _module(model, pname.rpartition(".")[0])
        if isinstance(owner, nn.Embedding):
            setattr(parent, child, QuantizedEmbedding(weight))
        else:
            bias = owner.bias.detach() if owner.bias is not None else None
            linear = QuantizedLinear(weight, bias)
            setattr(parent, child, linear if columns is None else PermutedInput(linear, columns))
            if bias is not None:  # the bias now lives in the new module
                params[pname.rpartition(".")[0] + ".bias"] = linear.bias
        return
    if info.qtype not in quant_linear.SUPPORTED:
        raise ValueError(f"{where} is {info.type_name}, which cannot be dequantized "
                         f"here (supported: {', '.join(quant_linear.SUPPORTED.values())})")
    value = _float(raw, info, shape)
    if columns is not None:
        value = value[..., columns]
    if arch.norm_shift and info.name.endswith("norm.weight") \
            and not info.name.endswith(arch.norm_kept):
        value = value - arch.norm_shift
    target = params[pname]
    if transform is not None:
        value = transform(value, tuple(target.shape))
    elif value.shape != target.shape:
        value = value.reshape(target.shape)  # shapes that differ by dimensions of 1
    with torch.no_grad():
        if target.is_meta or target.shape != value.shape:
            raise ValueError(f"{where} cannot be placed")
        target.copy_(value)


def _place_experts(model: nn.Module, pname: str, owner: nn.Module, raw: np.ndarray,
                   info: TensorInfo) -> None:
    """A 3-D expert tensor [experts, rows, cols] as one quantized matrix per expert (its rows
    are contiguous in the file); the StackedExperts is swapped for QuantizedStackedExperts on
    its first projection."""
    num_experts, rows, cols = info.shape
    if not isinstance(owner, QuantizedStackedExperts):
        parent, child = _module(model, pname.rpartition(".")[0])
        owner = QuantizedStackedExperts(owner, num_experts)  # type: ignore[arg-type]
        setattr(parent, child, owner)
    per_expert = raw.reshape(num_experts, rows, -1)
    owner.set(pname.rpartition(".")[2], [QuantizedLinear(QuantizedWeight(
        _tensor(per_expert[e]), info.qtype, rows, cols)) for e in range(num_experts)])


def _in_quantized(model: nn.Module, pname: str) -> bool:
    """Biases moved into quantized modules were loaded with their weight."""
    owner, _ = _module(model, pname)
    return isinstance(owner, QuantizedLinear)


def _tie_head(model: CausalLM, config: dict[str, Any]) -> None:
    """A tied head reads the embedding's quantized matrix (no second copy)."""
    embed = model.embed_tokens
    if config.get("tie_word_embeddings") and isinstance(embed, QuantizedEmbedding):
        model.lm_head = QuantizedLinear(embed.qweight)  # type: ignore[assignment]


def build_gguf_model(header: GGUFHeader, config: dict[str, Any], *,
                     dequantize: bool) -> CausalLM:
    """The model of a GGUF file on the CPU, float32 activations, weights loaded."""
    with no_init(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = build_model(config)
    mtp = load_gguf_weights(model, header, config, dequantize=dequantize)
    # Where a multi-token-prediction head will read its weights: listed, left in the file.
    model.mtp_tensors = mtp
    model.eval()
    return model

