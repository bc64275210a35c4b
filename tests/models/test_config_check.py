"""The config checker against transformers' config classes: every config a supported family's
class writes, or reads back with the fields it derives left out (as Hub configs leave them
out), passes the checker and plans; the fields the checker derives are the ones transformers
derives. Only dicts are read: no model is built, so the sizes may be the real defaults."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
from huggingface_hub.errors import StrictDataclassClassValidationError  # noqa: E402
from hypothesis import HealthCheck, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hybridkv.models.config_check import (  # noqa: E402
    DERIVED_FIELDS,
    check_config,
    with_derived_fields,
)
from hybridkv.models.layer_mix import kv_layout_from_config  # noqa: E402
from hybridkv.models.registry import MODELS  # noqa: E402

FAMILIES = sorted(t for t in MODELS if t in transformers.CONFIG_MAPPING)


def _drop(*names: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: {k: v for k, v in d.items() if k not in names}


def _rename(**names: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda d: {names.get(k, k): v for k, v in d.items()}


# model_type -> the config as older or hand-written configs spell it: derived fields left out,
# older field names (transformers reads both).
AS_HUB_WRITES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    **{t: _drop("intermediate_size") for t in ("mamba", "falcon_mamba", "mamba2", "zamba2")},
    "rwkv": _drop("intermediate_size", "attention_hidden_size"),
    "lfm2": _rename(intermediate_size="block_ff_dim"),
}


def accept(config: dict[str, Any], source: str) -> None:
    check_config(config, source, for_model=True)
    kv_layout_from_config(config, source=source)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_default_configs_pass(model_type):
    accept(transformers.CONFIG_MAPPING[model_type]().to_dict(), f"{model_type} defaults")


def test_mamba2_as_transformers_writes_it(tmp_path):
    # No intermediate_size: Mamba2's config has none, its width is expand x hidden.
    transformers.Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, expand=2,
                              num_hidden_layers=2).save_pretrained(tmp_path)
    from hybridkv.models.layer_mix import load_hf_config

    config = load_hf_config(str(tmp_path))
    assert "intermediate_size" not in config
    accept(config, "config.json")
    assert with_derived_fields(config)["intermediate_size"] == 128


@st.composite
def small_kwargs(draw: st.DrawFn, model_type: str) -> dict[str, Any]:
    """Sizes the family's config class takes: heads, KV heads dividing them, head size,
    layers (and the family's own spellings where it has them)."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    layers = draw(st.integers(1, 8))
    kwargs: dict[str, Any] = dict(hidden_size=heads * head_dim, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, num_hidden_layers=layers)
    if model_type == "mamba2":  # its SSM heads must cover expand x hidden
        expand = draw(st.sampled_from([1, 2]))
        kwargs.update(expand=expand, head_dim=head_dim,
                      num_heads=expand * kwargs["hidden_size"] // head_dim)
    if model_type.startswith("gemma3n"):  # its default (15) would exceed the layers
        kwargs["num_kv_shared_layers"] = draw(st.integers(0, layers - 1))
    if model_type == "zamba2":  # a list per layer, not derived from the layer count
        kwargs["layers_block_type"] = draw(st.lists(
            st.sampled_from(["mamba", "hybrid"]), min_size=layers, max_size=layers))
    return kwargs


def transformers_config(model_type: str, kwargs: dict[str, Any]) -> Any:
    """The family's config for `kwargs` (those it has fields for; a composite config takes
    them in its text config), or a rejected example where transformers refuses them or could
    not build the model from them."""
    cls = transformers.CONFIG_MAPPING[model_type]
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in kwargs.items() if k in fields or "text_config" in fields}
    try:
        config = cls(text_config=kwargs) if "text_config" in fields else cls(**kwargs)
        # Per-layer properties the model reads on construction (Gemma 3n's KV sharing).
        getattr(config.get_text_config(), "kv_sharing_modes", None)
    except (ValueError, TypeError, IndexError, KeyError, StrictDataclassClassValidationError):
        reject()
    return config


@pytest.mark.parametrize("model_type", FAMILIES)
@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(data=st.data())
def test_small_random_configs_pass(model_type, data):
    config = transformers_config(model_type, data.draw(small_kwargs(model_type)))
    written = config.to_dict()
    accept(written, f"{model_type} {written}")
    if model_type not in AS_HUB_WRITES:
        return
    hub = AS_HUB_WRITES[model_type](written)
    reread = type(config).from_dict(hub)  # transformers takes it and derives the rest
    accept(hub, f"{model_type} {hub}")
    derived = with_derived_fields(hub)
    for family, name in DERIVED_FIELDS:
        if family == model_type and DERIVED_FIELDS[family, name] is not None:
            # What transformers derived (Mamba2 keeps no intermediate_size: its model's width).
            expected = getattr(reread, name, None) if model_type != "mamba2" else \
                reread.expand * reread.hidden_size
            assert derived[name] == expected, name
