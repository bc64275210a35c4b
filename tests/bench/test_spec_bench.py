"""`hybridkv bench spec` on tiny models (the figures themselves mean nothing here): it runs
each workload with speculation on and off, the greedy tokens agree, drafts are scored on
the copy workload, and the ratio is the two figures' quotient."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv.bench.spec import text_workloads  # noqa: E402
from hybridkv.cli import main  # noqa: E402


def check(result: dict, workloads: set[str], *, drafts: bool = True) -> None:
    assert set(result["workloads"]) == workloads
    for w in result["workloads"].values():
        assert w["same_tokens"] is True
        assert w["off_decode_tok_s"] > 0 and w["on_decode_tok_s"] > 0
        assert w["ratio"] == pytest.approx(w["on_decode_tok_s"] / w["off_decode_tok_s"])
    if drafts:
        assert result["workloads"]["copy"]["num_draft_tokens"] > 0


def test_bench_spec_with_token_prompts_and_a_draft_model(tmp_path_factory, capsys):
    from tests.engine.test_spec_decode import tiny

    # No tokenizer: token-id prompts. The target drafts for itself (every draft kept).
    model = tiny("llama", tmp_path_factory)
    spec = json.dumps({"method": "draft_model", "model": str(model),
                       "num_speculative_tokens": 3})
    assert main(["bench", "spec", str(model), "--max-tokens", "12", "--rounds", "1",
                 "--batch", "2", "--max-model-len", "512", "--kv-cache-memory", "16MiB",
                 "--speculative-config", spec, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    check(result, {"copy", "prose"})
    assert result["prompts"].startswith("token ids")
    copy = result["workloads"]["copy"]
    assert copy["num_accepted_tokens"] == copy["num_draft_tokens"]


def test_bench_spec_with_text_prompts_prints_a_table(tmp_path, capsys):
    from hybridkv.models.demo import demo_shape, write_demo_model

    model = str(write_demo_model(tmp_path / "demo", "llama", demo_shape("small", layers=2)))
    assert main(["bench", "spec", model, "--max-tokens", "8", "--rounds", "1",
                 "--max-model-len", "1024", "--kv-cache-memory", "16MiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # (A random model's answer copies nothing: drafts may never be proposed.)
    check(result, {"copy", "edit", "prose"}, drafts=False)
    assert result["prompts"] == "text"
    assert result["llama_server_skipped"] == "the model is not a GGUF file"
    assert main(["bench", "spec", model, "--max-tokens", "4", "--rounds", "1",
                 "--max-model-len", "1024", "--kv-cache-memory", "16MiB"]) == 0
    table = capsys.readouterr().out
    assert "workload" in table and "copy" in table and "prose" in table


def test_text_workloads_take_distinct_excerpts():
    text = "".join(f"line {i} of the file\n" for i in range(400))
    workloads = text_workloads(text, 3)
    assert set(workloads) == {"copy", "edit", "prose"}
    copies = workloads["copy"]
    assert len(copies) == 3 and len(set(copies)) == 3
    assert all(c.startswith("Repeat the following text exactly") for c in copies)


def test_bench_spec_with_8bit_activations_on_the_real_gguf(capsys):
    """8-bit activations in both runs (each row's bytes do not depend on its batch, so the
    scored drafts keep the tokens of speculation off on the real SmolLM2 GGUF)."""
    from hybridkv.models.sources import real_model_path

    try:
        model = str(real_model_path("smollm2-135m-instruct"))
    except ValueError as e:
        pytest.skip(str(e))
    assert main(["bench", "spec", model, "--max-tokens", "16", "--rounds", "1",
                 "--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                 "--quant-activations", "int8", "--no-llama", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["quant_activations"] == "int8"
    check(result, {"copy", "edit", "prose"})
    copy = result["workloads"]["copy"]
    assert 0 < copy["num_accepted_tokens"] <= copy["num_draft_tokens"]


def test_bench_spec_beside_llama_server_on_the_real_gguf(capsys):
    """The same token-id prompts to llama-server on the same file, without speculation and
    with `--spec-type ngram-simple`; without its binaries, one line says how to build them."""
    from hybridkv.bench.gguf import DEFAULT_LLAMA_BIN
    from hybridkv.models.sources import real_model_path

    try:
        model = str(real_model_path("smollm2-135m-instruct"))
    except ValueError as e:
        pytest.skip(str(e))
    assert main(["bench", "spec", model, "--max-tokens", "8", "--rounds", "1",
                 "--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--threads", "1",
                 "--llama-spec-types", "ngram-simple", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    if not (DEFAULT_LLAMA_BIN / "llama-server").is_file():
        assert "setup.sh" in result["llama_server_skipped"]
        return
    peer = result["llama_server"]
    assert set(peer) == {"none", "ngram-simple"}
    for per in peer.values():
        assert set(per) == {"copy", "edit", "prose"}
        assert all(w["decode_tok_s"] > 0 for w in per.values())
    assert all(w["ratio"] == 1.0 for w in peer["none"].values())


def test_bench_spec_refuses_none_among_llama_spec_types(capsys):
    assert main(["bench", "spec", "x", "--llama-spec-types", "none"]) == 2
    assert "without speculation is always measured" in capsys.readouterr().err
