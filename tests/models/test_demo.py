"""`hybridkv demo-model` writes a model that transformers loads and that we run identically."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.cli import main  # noqa: E402
from hybridkv.models.demo import DemoShape, write_demo_model  # noqa: E402


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
