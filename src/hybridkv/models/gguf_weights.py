"""A GGUF file's tensors into a model built from its config, weights kept in their blocks.

Names: the model's parameters carry Hugging Face names; the `gguf` package's tensor-name map
(llama.cpp's own table, per architecture) turns each into the file's name
(`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`), so every family the
table covers needs no table here.

What stays quantized: the weight of every linear layer (any GGML type the kernels compute on,
F32/F16/BF16 included) and the embedding table, which a tied LM head shares. Norms, biases
and other small tensors are dequantized to float32. A matrix of a type the kernels lack is
refused in one line naming it, unless `dequantize=True` asks for float32 weights (the
choice on CUDA, where the model then runs as any float32 checkpoint does).

The converter's two rewrites are undone: llama-architecture q/k rows are permuted back (its
RoPE pairs neighbours, Hugging Face's pairs halves; quantization blocks run along rows, so
whole rows move), and Gemma's norm weights lose the 1 the converter added.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from hybridkv.models.base import CausalLM
from hybridkv.models.gguf_config import ARCHS
from hybridkv.models.gguf_file import GGUFHeader, TensorInfo
from hybridkv.models.registry import build_model
from hybridkv.worker import quant_linear
from hybridkv.worker.quant_linear import QuantizedWeight
from hybridkv.worker.quantized import QuantizedEmbedding, QuantizedLinear

# Tensors llama.cpp files may carry that the engine computes itself.
_DERIVED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Build a model without initialising the weights it is about to be given: a float32
    copy of a quantized model's matrices is never written, so its pages are never used."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = lambda self: None  # type: ignore[method-assign]
    nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def gguf_names(model: nn.Module, arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, for every parameter the table maps."""
    import gguf

    arch_id = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), None)
    if arch_id is None:
        raise ValueError(f"GGUF architecture {arch!r} is unknown to the gguf package")
    table = gguf.get_tensor_name_map(arch_id, num_layers)
    names: dict[str, str] = {}
    for param in dict(model.named_parameters(remove_duplicate=False)):
        gguf_name = table.get_name(param, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            names.setdefault(gguf_name, param)
    return names


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, its rows were [pairs of (first half i,
    second half i)]; Hugging Face keeps [first halves, second halves]."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


class _FileTensors:
    """Each tensor's bytes read once into memory of its own (no mapping of the file stays
    behind: its pages would count against the process as well)."""

    def __init__(self, header: GGUFHeader) -> None:
        self.header = header
        self._file = open(header.path, "rb")  # noqa: SIM115  (closed by close())

    def raw(self, info: TensorInfo) -> np.ndarray:
        """uint8 [rows, bytes per row] (rows: every dimension but the last)."""
        data = np.empty(info.nbytes, dtype=np.uint8)
        self._file.seek(info.offset)
        if self._file.readinto(memoryview(data)) != info.nbytes:
            raise ValueError(f"{self.header.path}: tensor {info.name!r} is cut short")
        rows = 1
        for d in info.shape[:-1]:
            rows *= d
        return data.reshape(rows, -1)

    def close(self) -> None:
        self._file.close()


def _quantized(raw: np.ndarray, info: TensorInfo) -> QuantizedWeight:
    data = torch.from_numpy(np.ascontiguousarray(raw))
    return QuantizedWeight(data, info.qtype, data.shape[0], info.shape[-1])


def _float(raw: np.ndarray, info: TensorInfo) -> torch.Tensor:
    data = torch.from_numpy(np.ascontiguousarray(raw))
    return quant_linear.dequantize(data, info.qtype, info.shape[-1]).reshape(info.shape)


def _module(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return model.get_submodule(parent), attr


def load_gguf_weights(model: CausalLM, header: GGUFHeader, config: dict[str, Any], *,
                      dequantize: bool) -> None:
    arch = ARCHS[header.architecture]
    names = gguf_names(model, header.architecture, int(config["num_hidden_layers"]))
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    files = _FileTensors(header)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    try:
        for info in header.tensors.values():
            if info.name in _DERIVED:
                continue
            pname = names.get(info.name)
            if pname is None:
                raise ValueError(f"{header.path}: tensor {info.name!r} has no place in "
                                 f"{config['model_type']}")
            if pname not in params:  # a tied parameter seen under its other name
                continue
            param = params[pname]
            if tuple(param.shape) != info.shape:
                raise ValueError(f"{header.path}: tensor {info.name!r} has shape "
                                 f"{list(info.shape)}, the model expects {list(param.shape)}")
            raw = files.raw(info)
            if arch.permuted_qk and info.name.endswith(("attn_q.weight", "attn_k.weight",
                                                        "attn_q.bias", "attn_k.bias")):
                raw = _unpermute_rows(raw, heads if "attn_q" in info.name else kv_heads)
            owner, attr = _module(model, pname)
            matrix = attr == "weight" and isinstance(owner, (nn.Linear, nn.Embedding))
            if matrix and not dequantize:
                if info.qtype not in quant_linear.SUPPORTED:
                    raise ValueError(
                        f"{header.path}: tensor {info.name!r} is {info.type_name}, which the "
                        f"quantized kernels do not compute on (supported: "
                        f"{', '.join(quant_linear.SUPPORTED.values())}); pass "
                        f"dequantize=True (--dequantize) to load it as float32")
                weight = _quantized(raw, info)
                parent, child = _module(model, pname.rpartition(".")[0])
                if isinstance(owner, nn.Embedding):
                    setattr(parent, child, QuantizedEmbedding(weight))
                else:
                    bias = owner.bias.detach() if owner.bias is not None else None
                    setattr(parent, child, QuantizedLinear(weight, bias))
                    if bias is not None:  # the bias now lives in the new module
                        params[pname.rpartition(".")[0] + ".bias"] = \
                            parent.get_submodule(child).bias
                loaded.add(pname)
                continue
            if info.qtype not in quant_linear.SUPPORTED:
                raise ValueError(f"{header.path}: tensor {info.name!r} is {info.type_name}, "
                                 f"which cannot be dequantized here (supported: "
                                 f"{', '.join(quant_linear.SUPPORTED.values())})")
            value = _float(raw, info)
            if arch.norm_shift and info.name.endswith("norm.weight"):
                value = value - arch.norm_shift
            with torch.no_grad():
                target = params[pname]
                if target.is_meta or target.shape != value.shape:
                    raise ValueError(f"{header.path}: tensor {info.name!r} cannot be placed")
                target.copy_(value)
            loaded.add(pname)
    finally:
        files.close()
    _tie_head(model, config)
    missing = [p for p in dict(model.named_parameters()) if p not in loaded
               and not _in_quantized(model, p)]
    if missing:
        raise ValueError(f"{header.path}: the file lacks {len(missing)} tensor(s) the model "
                         f"needs, e.g. {missing[0]!r}")


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
    with _no_init(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = build_model(config)
    load_gguf_weights(model, header, config, dequantize=dequantize)
    model.eval()
    return model

