"""`hybridkv demo-model` writes a model that transformers loads and that we run identically."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.cli import main  # noqa: E402
from hybridkv.models.demo import (  # noqa: E402
    SIZES,
    DemoShape,
    demo_config,
    demo_shape,
    nemotron_h_pattern,
    write_demo_model,
)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma3n"])
def test_demo_model_matches_transformers(tmp_path, arch):
    path = write_demo_model(tmp_path / arch, arch,
                            DemoShape(layers=10 if arch == "gemma3n" else 6, window=16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(3, 43))
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(path), max_model_len=128, kv_cache_memory="4MiB")
    [out] = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.token_ids == ref


def test_generate_cli_on_a_demo_model(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "m"), "--arch", "qwen3", "--layers", "2"]) == 0
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\nOnce upon a time\n")
    assert main(["generate", str(tmp_path / "m"), "--prompts-file", str(prompts),
                 "--max-tokens", "5", "--max-model-len", "64", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    results = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in results] == ["the quick brown fox", "Once upon a time"]
    assert all(1 <= len(r["token_ids"]) <= 5 for r in results)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "x"), "--arch", "bert"]) == 2
    assert "unknown demo architecture 'bert'" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "none"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_nemotron_h_demo_is_a_hybrid_at_any_length():
    assert nemotron_h_pattern(9) == "M-M-M-M*-"
    assert nemotron_h_pattern(6) == "M-M-*-"  # the CLI's default: not pure Mamba
    assert nemotron_h_pattern(3) == "M-*"
    for n in range(3, 30):
        assert set(nemotron_h_pattern(n)) == {"M", "*", "-"}, n


def test_nemotron_h_demo_model_has_an_attention_group(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "m"), "--arch", "nemotron_h"]) == 0
    assert main(["plan", str(tmp_path / "m"), "--json"]) == 0
    kinds = {g["kind"] for g in json.loads(capsys.readouterr().out.splitlines()[-1])["groups"]}
    assert {"mamba", "full"} <= kinds


def test_size_presets_and_overrides():
    assert demo_shape() == SIZES["small"]
    medium = demo_shape("medium")
    assert (medium.hidden, medium.layers, medium.head_dim) == (768, 12, 64)
    shape = demo_shape("medium", layers=2, hidden=384)
    assert (shape.hidden, shape.layers, shape.heads, shape.head_dim) == (384, 2, 12, 32)
    with pytest.raises(ValueError, match="hidden 256 is not a multiple of heads 12"):
        demo_shape("medium", hidden=256)
    assert demo_shape("medium", hidden=256, head_dim=32).head_dim == 32
    assert demo_shape("small", hidden=256).head_dim == 64


def test_medium_llama_has_about_100m_parameters(tmp_path):
    config = demo_config("llama", SIZES["medium"], SIZES["medium"].vocab)
    with torch.device("meta"):
        from hybridkv.models.registry import build_model

        model = build_model(config)
    assert 90e6 < sum(p.numel() for p in model.parameters()) < 120e6


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    import hybridkv.models.demo as demo

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(demo, "train_tokenizer", fail)
    with pytest.raises(OSError, match="disk full"):
        write_demo_model(tmp_path / "m", "llama", DemoShape(layers=2))
    assert list(tmp_path.iterdir()) == []


def test_writing_into_an_existing_directory_replaces_the_files(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "notes.txt").write_text("mine")
    write_demo_model(tmp_path / "m", "llama", DemoShape(layers=2))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "llama"
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
