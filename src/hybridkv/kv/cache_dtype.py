"""Choosing how each KV cache group stores its pages (`kv_cache_dtype`).

A rule, applied to a model's layer specs before planning:
- `kv_cache_dtype`: "auto" (pages in the model's dtype) or a quantized dtype ("int8", "q4",
  "fp8") for every attention layer;
- `skip`: attention kinds kept in the model's dtype (e.g. "sliding": a small window costs
  little and sees every token it keeps, so it is where precision is cheapest to keep);
- `state_dtype`: the dtype of recurrent states ("auto": as the model declares them).

The rule changes specs only, so the planner's page sizes, large pages, capacity and
`hybridkv plan` all follow from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from hybridkv.kv.spec import (
    CACHE_DTYPES,
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    dtype_size,
)

KV_CACHE_DTYPES = ("auto", *CACHE_DTYPES)
STATE_DTYPES = ("auto", "float32", "bf16", "fp16")
# Names a skip rule may use, and the spec kinds each stands for.
SKIP_KINDS = {
    "full": ("full",),
    "sliding": ("sliding_window",),
    "sliding_window": ("sliding_window",),
    "chunked": ("chunked_local",),
    "chunked_local": ("chunked_local",),
    "cross": ("cross_attention",),
    "cross_attention": ("cross_attention",),
}


def check_kv_cache_dtype(name: str) -> str:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; accepted: "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return name


def check_state_dtype(name: str) -> str:
    if name not in STATE_DTYPES:
        raise ValueError(f"unknown state_dtype {name!r}; accepted: {', '.join(STATE_DTYPES)}")
    return name


def parse_skip(skip: str | Iterable[str] | None) -> tuple[str, ...]:
    """"sliding", "sliding,cross" or a list -> the names, each checked."""
    if skip is None:
        return ()
    names = [s.strip() for s in (skip.split(",") if isinstance(skip, str) else skip)]
    names = [n for n in names if n]
    for n in names:
        if n not in SKIP_KINDS:
            raise ValueError(f"unknown kv_cache_dtype_skip kind {n!r}; accepted: "
                             f"{', '.join(SKIP_KINDS)}")
    return tuple(names)


def apply_cache_dtype(layer_specs: Mapping[str, KVCacheSpec], kv_cache_dtype: str = "auto",
                      skip: str | Iterable[str] | None = None,
                      state_dtype: str = "auto") -> dict[str, KVCacheSpec]:
    """The specs with the rule applied. A rule that would silently do nothing is refused: a
    skip naming a kind the model has no layer of, a skip without a quantized dtype, a skip
    that keeps every attention layer (so the dtype quantizes nothing), a quantized dtype on
    a model without attention layers, a state dtype on a model without states."""
    check_kv_cache_dtype(kv_cache_dtype)
    check_state_dtype(state_dtype)
    skipped = parse_skip(skip)
    kinds = {spec.kind for spec in layer_specs.values()}
    for name in skipped:
        if kv_cache_dtype == "auto":
            raise ValueError(f"kv_cache_dtype_skip {name!r} needs a quantized kv_cache_dtype "
                             f"({', '.join(CACHE_DTYPES)}); with 'auto' nothing is quantized")
        if not kinds.intersection(SKIP_KINDS[name]):
            raise ValueError(f"kv_cache_dtype_skip {name!r} names no layer of this model; its "
                             f"attention kinds: {', '.join(sorted(kinds - {'mamba'})) or 'none'}")
    keep = {kind for name in skipped for kind in SKIP_KINDS[name]}
    # A rule that changes nothing is refused too: someone asked for smaller pages or states
    # and would otherwise run the model as it was without a word.
    attention = {spec.kind for spec in layer_specs.values() if isinstance(spec, AttentionSpec)}
    if kv_cache_dtype != "auto" and not attention:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) {kv_cache_dtype!r} quantizes "
                         f"attention pages, and this model has no attention layer (its "
                         f"layers: {', '.join(sorted(kinds))}); leave it 'auto'"
                         + ("; state_dtype sets its states' dtype"
                            if any(isinstance(s, MambaSpec) for s in layer_specs.values())
                            else ""))
    if kv_cache_dtype != "auto" and not attention - keep:
        raise ValueError(f"kv_cache_dtype_skip (--kv-cache-dtype-skip) "
                         f"{','.join(skipped)!r} keeps every attention layer of this model "
                         f"({', '.join(sorted(attention))}) in the model's dtype, so "
                         f"kv_cache_dtype {kv_cache_dtype!r} would quantize nothing; skip "
                         f"fewer kinds, or leave kv_cache_dtype 'auto'")
    if state_dtype != "auto" and not any(isinstance(s, MambaSpec)
                                         for s in layer_specs.values()):
        raise ValueError(f"state_dtype (--state-dtype) {state_dtype!r} sets the dtype of "
                         f"recurrent states (Mamba, linear attention), and this model has "
                         f"none (its layers: {', '.join(sorted(kinds))}); leave it 'auto'")
    out: dict[str, KVCacheSpec] = {}
    for layer, spec in layer_specs.items():
        if isinstance(spec, AttentionSpec) and kv_cache_dtype != "auto" and \
                spec.kind not in keep:
            spec = replace(spec, cache_dtype=kv_cache_dtype)
        elif isinstance(spec, MambaSpec) and state_dtype != "auto":
            dtype_size(state_dtype)
            spec = replace(spec, dtypes=(state_dtype,) * len(spec.dtypes))
        out[layer] = spec
    return out
