"""What every causal LM here shares around its decoder layers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from hybridkv.models.layer_mix import kv_shared_from
from hybridkv.models.layers.norms import RMSNorm
from hybridkv.models.text_config import TextConfig
from hybridkv.models.weights import load_named_weights
from hybridkv.worker.forward_context import ForwardContext
from hybridkv.worker.head import bound as head_bound
from hybridkv.worker.head.bound import HeadBound
from hybridkv.worker.head.topk import HeadCandidates, HeadTopK
from hybridkv.worker.linear import quant as quant_linear
from hybridkv.worker.linear.layers import Linear
from hybridkv.worker.linear.quantized import QuantizedLinear


class CausalLM(nn.Module):
    """forward(token ids [T], positions [T], ctx) -> hidden [T, hidden] (with KV-sharing fast
    prefill, only the sampled tokens' rows); compute_logits(hidden [N, hidden]) -> [N, vocab].

        embed (x sqrt(hidden) for Gemma, x embedding_multiplier for µP)
          -> layers; at `kv_shared_from` (the trailing run of layers that only read other
             layers' KV) the context may narrow the batch to the sampled tokens
          -> final norm
        logits = lm_head (tied to the embedding if the config says so)
                 x logits multiplier (µP), soft-capped (Gemma 2, 3n, 4)

    Subclasses build the layers and name the embedding and final norm as their checkpoints
    do (`embed_name`, `norm_name`). Families with more state between layers (per-layer
    inputs, AltUp copies) override the hooks `per_layer_inputs`, `enter_layers`,
    `leave_layers`; the loop, and so the KV-sharing cut, stays here."""

    embed_name: ClassVar[str] = "embed_tokens"
    norm_name: ClassVar[str] = "norm"
    # Whether the attention reads a target layer's cache when the config maps layers to
    # others (`num_kv_shared_layers` / `kv_sharing_target_layers`); the registry refuses
    # such configs for other families, which would write their own K/V into the target's.
    supports_kv_sharing: ClassVar[bool] = False
    # Checkpoint tensors of parts text generation does not run (vision/audio towers).
    unused_prefixes: ClassVar[tuple[str, ...]] = ()
    # kv_cache_dtype values a family's attention cannot read, with why: refused at load in
    # one line (engine/build.py), not at a request's first step.
    refused_cache_dtypes: ClassVar[dict[str, str]] = {}
    # Name endings of checkpoint tensors the family keeps as integers (lookup tables); every
    # other tensor must be floating point.
    integer_weights: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: TextConfig, layers: Iterable[nn.Module], *,
                 norm_offset: float = 0.0, embed_scale: float | None = None,
                 model: nn.Module | None = None) -> None:
        """`model`: the container the checkpoint calls `model` when it holds more than the
        embedding, layers and norm (Gemma 3n's per-layer inputs); a plain one otherwise."""
        super().__init__()
        self.cfg = cfg
        self.model = model if model is not None else nn.Module()
        self.model.add_module(self.embed_name, nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.model.layers = nn.ModuleList(layers)
        self.model.add_module(self.norm_name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                      norm_offset))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.embed_scale = embed_scale
        self.kv_shared_from = kv_shared_from(cfg.kv_targets, cfg.num_layers)
        # Checkpoints written by transformers keep k/v weights for layers that read another
        # layer's KV (it has no notion of the map); nothing uses them here.
        self.unused_weights = self.unused_prefixes + tuple(
            f"model.layers.{i}.self_attn.{part}." for i in cfg.kv_targets
            for part in ("k_proj", "v_proj", "k_norm", "v_norm"))

    @property
    def embed_tokens(self) -> nn.Embedding:
        return getattr(self.model, self.embed_name)  # type: ignore[no-any-return]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # Rounded to the embedding's dtype first, as the reference does.
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        if self.cfg.embedding_multiplier != 1.0:
            h = h * self.cfg.embedding_multiplier
        return h

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor
                         ) -> torch.Tensor | None:
        """[T, layers, dim]: a small input per token and layer, or None."""
        return None

    def enter_layers(self, h: torch.Tensor) -> torch.Tensor:
        """The embedding [T, hidden] -> what the layers pass on ([..., T, hidden])."""
        return h

    def leave_layers(self, h: torch.Tensor) -> torch.Tensor:
        return h

    @staticmethod
    def _cut_rows(layer: nn.Module, h: torch.Tensor, positions: torch.Tensor,
                  ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h, positions) after `layer` at the step's sampled rows alone, or None where the
        layer's KV group does not allow it (see ForwardContext.cut_to_sampled)."""
        rows = ctx.sampled_tokens
        assert rows is not None
        if layer.rows_only:
            h, positions = h[rows], positions[rows]
            return (layer(h, positions, ctx) if rows.numel() else h), positions
        out = layer.forward_rows(h, positions, ctx)
        return None if out is None else (out, positions[rows])

    @property
    def _cut_layer(self) -> int | None:
        """The first layer from which only the sampled rows need computing, or None: the
        last that mixes tokens, where that is a plain attention layer (it writes every
        token's K/V and computes the rest for those rows), else the first of the per-row
        layers after it (NemotronH's trailing MLPs). The residual stream must be the rows
        themselves in and out (no AltUp streams)."""
        cls = type(self)
        if cls.enter_layers is not CausalLM.enter_layers or \
                cls.leave_layers is not CausalLM.leave_layers:
            return None
        layers = list(self.model.layers)  # type: ignore[arg-type]
        i = len(layers)
        while i > 0 and getattr(layers[i - 1], "rows_only", False):
            i -= 1
        if i > 0 and getattr(layers[i - 1], "cuts_rows", False):
            return i - 1
        return i if i < len(layers) else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        h = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, h)
        h = self.enter_layers(h)
        native = self.native_decode
        if native is not None and native.takes(h, ctx):
            # A decode step on the common quantized layer: all layers in one C call.
            out = native(h, positions, ctx)
            if out is not None:
                return getattr(self.model, self.norm_name)(out)  # type: ignore[no-any-return]
        # Past the last layer only the sampled rows are read: from `cut_at` on, the layers
        # run on those rows alone (the one at `cut_at` still writes every token's K/V).
        cut_at = self._cut_layer if per_layer is None and ctx.sampled_ctx is not None \
            else None
        for i, layer in enumerate(self.model.layers):  # type: ignore[arg-type]
            if i == cut_at:
                cut = self._cut_rows(layer, h, positions, ctx)
                if cut is not None:  # else its group does not allow it: every row goes on
                    h, positions = cut
                    ctx.rows_cut = True
                    if h.shape[0] == 0:  # nothing samples: the K/V was all to compute
                        break
                    continue
            if i == self.kv_shared_from:
                # No layer from here on writes KV: with fast prefill only the tokens whose
                # logits are sampled need to go on.
                ctx, keep = ctx.enter_kv_shared_layers()
                if keep is not None:
                    h, positions = h[..., keep, :], positions[keep]
                    per_layer = per_layer[keep] if per_layer is not None else None
            if per_layer is None:
                h = layer(h, positions, ctx)
            else:
                h = layer(h, positions, ctx, per_layer[:, i])
        return getattr(self.model, self.norm_name)(self.leave_layers(h))  # type: ignore[no-any-return]

    # A head tied to the embedding gets a packed copy of its own on the CPU kernels up to
    # this size: oneDNN's GEMM is 1.2-2x faster than F.linear's on the plain weight (2x at a
    # 32K x 2,048 head), worth the memory on CPU hosts; above it the head stays shared.
    TIED_HEAD_COPY_BYTES = 256 << 20

    # Heads of at least this many weights get an 8-bit pre-pass for greedy rows on the CPU
    # kernels (worker/head/bound.py): an 8-bit copy of the head (a quarter of a float
    # head's bytes, plus an eighth for its bounds' norms).
    HEAD_BOUND_WEIGHTS = 1 << 24
    OWN_PRODUCT_HEADS = frozenset({12, 14})  # GGML Q4_K, Q6_K: see _build_head_bound
    head_bound: HeadBound | None = None
    # The layers as one C call for decode steps (models/native_decode.py), where they fit.
    native_decode: Any = None

    @property
    def logits_size(self) -> int:
        """The width of compute_logits' rows: the token ids a step can sample."""
        return self.cfg.vocab_size

    def fuse_linears(self, kernel: str) -> None:
        """The LM head on `kernel` (see worker/linear/layers.py); a tied head only on the CPU
        kernels ("cpu", "onednn"), as a copy, up to TIED_HEAD_COPY_BYTES. On those kernels a
        large head also gets its greedy pre-pass."""
        if kernel in ("cpu", "onednn"):
            self.head_bound = self._build_head_bound()
        if not isinstance(self.lm_head, nn.Linear):
            return
        weight = self.lm_head.weight
        if weight is not self.embed_tokens.weight or (
                kernel in ("cpu", "onednn")
                and weight.numel() * weight.element_size() <= self.TIED_HEAD_COPY_BYTES):
            self.lm_head = Linear([self.lm_head], kernel)

    def _build_head_bound(self) -> HeadBound | None:
        """The head's pre-pass, where it is large, unbiased and its exact rows stay readable:
        a quantized head, or a float32 head tied to the embedding (its rows stay there
        whatever the CPU kernel makes of the head; an untied head the kernel packs would
        need its rows kept twice)."""
        head, cfg = self.lm_head, self.cfg
        if cfg.final_logit_softcap is not None or cfg.logits_multiplier <= 0:
            return None  # the argmax of the raw logits must be the argmax of the scaled ones
        if isinstance(head, QuantizedLinear):
            w = head.qweight
            if head.bias is not None or w.rows * w.cols < self.HEAD_BOUND_WEIGHTS:
                return None
            if not quant_linear.FLOAT_ACTIVATIONS and w.qtype in self.OWN_PRODUCT_HEADS and \
                    quant_linear.int8_capable(w.qtype):
                # With 8-bit activations a Q4_K / Q6_K head's own product is integer dot
                # products on fewer bytes than the copy's: as fast at batch 1 (Qwen3.5-0.8B's
                # 248k x 1024 Q6_K head, 17.7 vs 17.6 tok/s; at 32 rows 2-3% slower) for
                # 274 MiB less RSS. A Q8_0 head's bytes are the copy's (its product ran 1.6x
                # the copy's time, AVX2); Q4_0 and Q5_K's products were slower too.
                return None
            return HeadBound.of_quantized(w)
        if not isinstance(head, nn.Linear) or head.bias is not None:
            return None
        weight = head.weight
        if weight.numel() < self.HEAD_BOUND_WEIGHTS or weight is not self.embed_tokens.weight:
            return None
        return HeadBound.of_float(weight)

    # Heads of at least this many weights, on the CPU in float32, are computed a block of
    # vocabulary rows at a time as W_block h^T (see _head_blocks); smaller heads whole.
    BLOCKED_HEAD_WEIGHTS = 1 << 24
    HEAD_BLOCK_ROWS = 2048  # 5 MiB of float32 weights at a 640-wide head

    def _head_blocks(self, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]] | None:
        """The head's logits a block of vocabulary rows at a time: (r0, [n, N] float32, a
        buffer reused per block, the multiplier and soft cap applied), or None where the
        head is computed whole (small heads, one row, other devices and dtypes, packed or
        biased heads). A 262k x 640 head at 32 rows runs ~1.3-1.5x faster this way than
        as one h W^T (torch's GEMM with the vocabulary as its rows; measured on an AVX2
        core), and a greedy step reduces each block as it comes (head_candidates)."""
        head, n = self.lm_head, hidden.shape[0]
        if (n < 2 or hidden.dim() != 2 or hidden.device.type != "cpu"
                or hidden.dtype != torch.float32):
            return None
        x = hidden.contiguous()
        blocks: Iterator[tuple[int, torch.Tensor]]
        if isinstance(head, QuantizedLinear):
            w = head.qweight
            # The quantized kernel (batch invariant: a row's logits are the same bytes at
            # any batch), unless its order does not apply: then blocks from LARGE_M rows.
            if (head.bias is not None or w.rows * w.cols < self.BLOCKED_HEAD_WEIGHTS
                    or n < quant_linear.LARGE_M or quant_linear.takes_gemm(w.qtype, w.cols)):
                return None
            blocks = quant_linear.transposed_chunks(x, w.data, w.qtype, w.cols,
                                                    self.HEAD_BLOCK_ROWS)
        elif isinstance(head, nn.Linear):
            weight = head.weight
            if (head.bias is not None or weight.dtype != torch.float32
                    or weight.numel() < self.BLOCKED_HEAD_WEIGHTS or weight.stride(1) != 1):
                return None
            blocks = _float_blocks(weight, x, self.HEAD_BLOCK_ROWS)
        else:
            return None
        return self._scaled(blocks)

    def _scaled(self, blocks: Iterator[tuple[int, torch.Tensor]]
                ) -> Iterator[tuple[int, torch.Tensor]]:
        mult, cap = self.cfg.logits_multiplier, self.cfg.final_logit_softcap
        for r0, y in blocks:
            if mult != 1.0:
                y.mul_(mult)
            if cap is not None:
                y.div_(cap).tanh_().mul_(cap)
            yield r0, y

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        blocks = self._head_blocks(hidden)
        if blocks is not None:
            logits = hidden.new_empty((hidden.shape[0], self.lm_head.out_features))
            for r0, y in blocks:
                logits[:, r0:r0 + y.shape[0]].copy_(y.T)
            return logits
        return self._scale(self.lm_head(hidden))

    def _scale(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output times the logits multiplier (µP), soft-capped (Gemma 2, 3n, 4)."""
        if self.cfg.logits_multiplier != 1.0:
            logits = logits * self.cfg.logits_multiplier
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def head_candidates(self, hidden: torch.Tensor, k: int) -> HeadCandidates | None:
        """The k largest logits of compute_logits(hidden) per row, in order (k = 1: the
        argmax, the first index of the maximum as torch.argmax), reduced a block of the
        vocabulary at a time so the [N, vocab] logits are never written; None where the
        head is computed whole or a family changes compute_logits (the caller then takes
        the full logits). The blocks are the ones compute_logits copies out, so the
        candidates are those of its logits; a row with a NaN logit is flagged. A head with
        a pre-pass (head_bound) gives the same tokens from the few that can be among the
        k, scored exactly (values equal to ~1e-6)."""
        if type(self).compute_logits is not CausalLM.compute_logits:
            return None
        bound = self.head_bound
        if (bound is not None and k <= head_bound.MAX_K and hidden.dim() == 2
                and hidden.device.type == "cpu"):
            # The 8-bit pre-pass: a quarter of a float head's bytes at one row, ~2x fewer
            # instructions than the float GEMM's at 32 (an AVX2 core).
            found = bound.head_candidates(hidden, k, self._scale)
            if found is not None:
                return found
        blocks = self._head_blocks(hidden)
        if blocks is None:
            return None
        top = HeadTopK(hidden.shape[0], k)
        for r0, y in blocks:
            top.update(r0, y)
        return top.result()

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden [H])[ids] from the head rows of `ids` alone (structured
        output's rows that allow a few tokens); None where the head is not a plain row
        lookup (packed or biased heads, families that change compute_logits). The values
        are the same dot products, summed in another order: equal to ~1e-6."""
        if type(self).compute_logits is not CausalLM.compute_logits:
            return None
        head = self.lm_head
        if isinstance(head, QuantizedLinear) and head.bias is None:
            rows = head.qweight.rows_of(ids)
        elif isinstance(head, nn.Linear) and head.bias is None:
            rows = head.weight.detach().index_select(0, ids)
        else:
            return None
        return self._scale(rows.to(hidden.dtype) @ hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, model_type=self.cfg.model_type,
                           tied=self.cfg.tie_word_embeddings, unused=self.unused_weights)


def _float_blocks(weight: torch.Tensor, x: torch.Tensor, block_rows: int
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    """(r0, weight[r0:r0 + n] x^T as [n, N]), one reused buffer."""
    rows = weight.shape[0]
    block = max(1, min(block_rows, rows))
    buf = x.new_empty((block, x.shape[0]))
    xt = x.T
    for r0 in range(0, rows, block):
        n = min(block, rows - r0)
        y = buf[:n]
        torch.mm(weight[r0:r0 + n].detach(), xt, out=y)  # no autograd: out= refuses it
        yield r0, y
