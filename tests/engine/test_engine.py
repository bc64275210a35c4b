"""The engine on a tiny Llama: bad input, stop conditions, sampling, streaming."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.models.demo import train_tokenizer  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    train_tokenizer(path, vocab_size=256)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")


def test_text_prompts_are_tokenized_and_outputs_detokenized(llm):
    [out] = llm.generate("the quick brown fox", SamplingParams(max_tokens=8))
    assert len(out.token_ids) == 8
    assert out.text == llm.engine.tokenizer.decode(out.token_ids)
    assert out.prompt_token_ids == llm.engine.tokenizer.encode("the quick brown fox").ids


def test_stop_token_and_stop_string(llm):
    [free] = llm.generate([5, 6, 7], SamplingParams(max_tokens=12))
    stop_at = free.token_ids[3]
    [out] = llm.generate([5, 6, 7], SamplingParams(max_tokens=12, stop_token_ids=[stop_at]))
    assert out.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    text = free.text
    if len(text) >= 3:
        stop = text[1:3]
        [cut] = llm.generate([5, 6, 7], SamplingParams(max_tokens=12, stop=[stop]))
        assert cut.text == text[:text.index(stop)]
        assert cut.finish_reason == "stop"


def test_eos_stops_unless_ignored(model_dir, llm):
    [free] = llm.generate([9, 8], SamplingParams(max_tokens=10))
    eos = free.token_ids[2]
    config = model_dir / "generation_config.json"
    saved = config.read_text()
    config.write_text(json.dumps({"eos_token_id": [eos]}))
    try:
        with_eos = LLM(str(model_dir), dtype="float32", max_model_len=64,
                       kv_cache_memory="4MiB")
    finally:
        config.write_text(saved)
    [stopped] = with_eos.generate([9, 8], SamplingParams(max_tokens=10))
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop"
    [ignored] = with_eos.generate([9, 8], SamplingParams(max_tokens=10, ignore_eos=True))
    assert ignored.token_ids == free.token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    [alone] = llm.generate([3, 4, 5], params)
    batch = llm.generate([[3, 4, 5], [10, 11]], [params, SamplingParams(max_tokens=4)])
    assert batch[0].token_ids == alone.token_ids


def test_logprobs_on_request(llm):
    [out] = llm.generate([3, 4, 5], SamplingParams(max_tokens=3, logprobs=2))
    assert len(out.logprobs) == 3
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and all(v <= 0 for v in entry.values())


def test_streaming_steps_deliver_one_token_at_a_time(llm):
    engine = llm.engine
    engine.add_request("s", [1, 2, 3], SamplingParams(max_tokens=4))
    seen = []
    while engine.has_unfinished:
        for out in engine.step():
            seen.append(out.new_token_ids)
    assert [len(x) for x in seen] == [1, 1, 1, 1]


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    ("", SamplingParams(), "prompt is empty"),
    (list(range(70)), SamplingParams(), "max_model_len is 64"),
    ([1, 9999], SamplingParams(), "outside the vocabulary"),
    ([1, 2], {"max_tokens": 2, "beam_width": 3}, "unknown sampling field(s) beam_width"),
])
def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(llm, prompt, params,
                                                                     message):
    engine = llm.engine
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.add_request("bad", prompt, params)
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["ok"]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_model_paths_and_options(tmp_path, model_dir):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="missing config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported architecture model_type='bert'"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(str(model_dir), max_batch=3)
    with pytest.raises(ValueError, match="dtype 'int4' cannot run"):
        LLM(str(model_dir), dtype="int4")


def test_mismatched_checkpoint_shapes_are_reported(tmp_path, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"has shape \(.*\), the model expects \(.*96"):
        LLM(str(bad), dtype="float32")
    (bad / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="missing model.safetensors"):
        LLM(str(bad), dtype="float32")


def test_sharded_checkpoints_load_like_single_files(tmp_path, model_dir, llm):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for file in ("config.json", "generation_config.json", "tokenizer.json"):
        (sharded / file).write_bytes((model_dir / file).read_bytes())
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    other = LLM(str(sharded), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")
    params = SamplingParams(max_tokens=6)
    assert other.generate([4, 5, 6], params)[0].token_ids == \
        llm.generate([4, 5, 6], params)[0].token_ids
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing weight shard model-00002-of-00002"):
        LLM(str(sharded), dtype="float32")
