"""GGUF files as model sources: how they are named, planned without torch, and refused when
broken (one line naming the file and the key or tensor, never a traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hybridkv import LLM
from hybridkv.models.formats.gguf_config import config_from_gguf
from hybridkv.models.formats.gguf_file import read_header
from hybridkv.models.sources import resolve_model
from tests.models.gguf_writer import write_gguf
from tests.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf_files")
    # Rows of 256 values, so that K-quant types fit.
    model_dir = build_tiny_model("llama", root / "hf", hidden_size=256, intermediate_size=512,
                                 head_dim=64)
    return write_gguf(model_dir, root / "tiny.gguf", default=T.Q8_0)


def _load(path: Path) -> str:
    with pytest.raises(ValueError) as info:
        LLM(str(path), max_model_len=64, kv_cache_memory="4MiB")
    message = str(info.value)
    assert "\n" not in message
    return message


def _edit(src: Path, dst: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    edit(data)
    dst.write_bytes(bytes(data))
    return dst


def test_a_directory_holding_one_gguf_is_that_model(tiny_gguf, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.gguf").write_bytes(tiny_gguf.read_bytes())
    assert resolve_model(str(tmp_path / "m")).path == tmp_path / "m" / "x.gguf"
    (tmp_path / "m" / "y.gguf").write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        resolve_model(str(tmp_path / "m"))


def test_plan_reads_a_gguf_without_torch(tiny_gguf):
    code = ("import sys, json; from hybridkv.cli import main; "
            f"main(['plan', {str(tiny_gguf)!r}, '--memory', '64MiB', '--max-model-len', "
            "'256', '--json']); assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["model_type"] == "llama"


def test_config_matches_the_checkpoint_it_came_from(tiny_gguf):
    config = config_from_gguf(read_header(tiny_gguf))
    hf = json.loads((tiny_gguf.parent / "hf" / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size"):
        assert config[key] == hf[key], key


def test_wrong_magic(tiny_gguf, tmp_path):
    bad = _edit(tiny_gguf, tmp_path / "bad.gguf", lambda d: d.__setitem__(slice(0, 4), b"GGML"))
    assert "not a GGUF file" in _load(bad) and "bad.gguf" in _load(bad)


def test_truncated_header_and_truncated_data(tiny_gguf, tmp_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(tiny_gguf.read_bytes()[:200])
    assert "truncated GGUF header" in _load(short)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-1000])
    message = _load(cut)
    assert "cut.gguf" in message and "past the end of the file" in message


def _rewrite(src: Path, dst: Path, *, arch: str | None = None, meta=None,
             retype: dict[str, T] | None = None, reshape: dict[str, tuple] | None = None
             ) -> Path:
    """A copy of `src` with its architecture, metadata or tensors changed."""
    reader = gguf.GGUFReader(str(src))
    old_arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        name = key.replace(old_arch + ".", (arch or old_arch) + ".", 1)
        if meta and name in meta:
            value = meta.pop(name)
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
    for name, value in (meta or {}).items():
        writer.add_string(name, value) if isinstance(value, str) else writer.add_uint32(
            name, value)
    for t in reader.tensors:
        data = np.array(t.data)
        qtype = t.tensor_type
        if retype and t.name in retype:
            qtype = retype[t.name]
            values = gguf.quants.dequantize(data, t.tensor_type)
            data = values.astype(np.float16) if qtype == T.F16 else values
            if qtype not in (T.F16, T.F32):
                data = np.zeros((values.shape[0], values.shape[1] // 256 * 84), np.uint8)
        if reshape and t.name in reshape:
            values = gguf.quants.dequantize(data, t.tensor_type)
            data, qtype = np.zeros(reshape[t.name], np.float32), T.F32
            data.flat[:min(data.size, values.size)] = values.flat[:data.size]
        writer.add_tensor(t.name, data, raw_dtype=qtype if qtype not in (T.F32,) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unknown_architecture(tiny_gguf, tmp_path):
    bad = _rewrite(tiny_gguf, tmp_path / "arch.gguf", arch="bert")
    message = _load(bad)
    assert "GGUF architecture 'bert' is not supported" in message and "arch.gguf" in message


def test_metadata_of_the_wrong_type(tiny_gguf, tmp_path):
    bad = _rewrite(tiny_gguf, tmp_path / "meta.gguf", meta={"llama.block_count": "two"})
    message = _load(bad)
    assert "llama.block_count" in message and "meta.gguf" in message


def test_an_unsupported_tensor_type_names_the_tensor(tiny_gguf, tmp_path):
    bad = _rewrite(tiny_gguf, tmp_path / "q2k.gguf", retype={"blk.0.ffn_up.weight": T.Q2_K})
    message = _load(bad)
    assert "blk.0.ffn_up.weight" in message and "Q2_K" in message and "--dequantize" in message


def test_a_tensor_of_the_wrong_shape(tiny_gguf, tmp_path):
    bad = _rewrite(tiny_gguf, tmp_path / "shape.gguf", reshape={"blk.1.attn_norm.weight": (3,)})
    message = _load(bad)
    assert "blk.1.attn_norm.weight" in message and "shape" in message


def test_cli_names_the_file_in_one_line(tmp_path):
    bad = tmp_path / "empty.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 8)
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "generate", str(bad),
                          "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "empty.gguf" in lines[0], out.stderr
