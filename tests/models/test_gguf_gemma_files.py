"""Broken Gemma 3n / Gemma 4 files (written by tests/models/gguf_writer.py, then edited): each
is refused in one line naming the file and what is wrong."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hybridkv import LLM
from tests.models.gguf_writer import copy_field, write_gguf
from tests.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma_files")
    return {name: write_gguf(build_tiny_model(arch, root / name), root / f"{name}.gguf",
                             default=T.Q8_0)
            for name, arch in (("gemma3n", "gemma3n"), ("gemma4", "gemma4_text"))}


def _copy(src: Path, dst: Path, *, meta: dict[str, object] | None = None,
          drop: str | None = None, add: dict[str, str] | None = None) -> Path:
    """`src` with metadata keys replaced (as uint32 arrays or values), one tensor left out,
    or tensors added (`add`: new name -> the tensor whose data it copies)."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if meta and key in meta:
            value = meta[key]
            if isinstance(value, list):
                writer.add_array(key, value)
            continue
        copy_field(writer, key, field)
    by_name = {t.name: t for t in reader.tensors}
    for name, t in [*((t.name, t) for t in reader.tensors if t.name != drop),
                    *((new, by_name[old]) for new, old in (add or {}).items())]:
        writer.add_tensor(name, np.array(t.data), raw_dtype=t.tensor_type
                          if t.tensor_type != T.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _refused(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        LLM(str(path), max_model_len=64, kv_cache_memory="4MiB")
    message = str(info.value)
    assert "\n" not in message and path.name in message
    return message


def test_gemma4_mlp_widths_that_fit_no_layer_mix(gemma_files, tmp_path):
    bad = _copy(gemma_files["gemma4"], tmp_path / "ff.gguf",
                meta={"gemma4.feed_forward_length": [128, 256, 128, 128, 256, 256, 256, 256]})
    assert "feed_forward_length" in _refused(bad)


def test_gemma4_without_one_expert_projection(gemma_files, tmp_path):
    bad = _copy(gemma_files["gemma4"], tmp_path / "exps.gguf",
                drop="blk.2.ffn_down_exps.weight")
    assert "lacks" in _refused(bad)


def test_gemma_without_the_sliding_pattern(gemma_files, tmp_path):
    bad = _copy(gemma_files["gemma3n"], tmp_path / "pattern.gguf",
                meta={"gemma3n.attention.sliding_window_pattern": None})
    assert "sliding_window_pattern" in _refused(bad)


def test_gemma3n_without_its_per_layer_table(gemma_files, tmp_path):
    bad = _copy(gemma_files["gemma3n"], tmp_path / "table.gguf",
                drop="per_layer_token_embd.weight")
    assert "per_layer_token_embd.weight" in _refused(bad)


def test_gemma3n_with_kv_projections_in_its_kv_reading_layers(gemma_files, tmp_path):
    """Released Gemma 3n checkpoints keep attn_k / attn_v / attn_k_norm in the layers that
    read another layer's KV (the tiny model's layers 4-7), and llama.cpp's converter writes
    them: such a file opens, leaves them unread, and generates as the file without them."""
    from hybridkv import SamplingParams

    parts = ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")
    full = _copy(gemma_files["gemma3n"], tmp_path / "kv.gguf",
                 add={f"blk.{i}.{part}": f"blk.3.{part}" for i in range(4, 8) for part in parts})
    prompts = [[5, 9, 33, 7, 120, 64, 2, 8], [40, 41, 42]]
    greedy = SamplingParams(max_tokens=6)
    outs = [LLM(str(path), max_model_len=64, kv_cache_memory="4MiB").generate(prompts, greedy)
            for path in (gemma_files["gemma3n"], full)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    # A tensor the model has no place for is still refused.
    bad = _copy(gemma_files["gemma3n"], tmp_path / "extra.gguf",
                add={"blk.2.attn_zz.weight": "blk.2.attn_k.weight"})
    assert "attn_zz" in _refused(bad)
