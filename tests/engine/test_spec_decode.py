"""Speculative decoding (n-gram prompt lookup) on tiny random models: greedy tokens with
drafts equal the tokens without, on attention, sliding-window, chunked, KV-sharing and
state families and their hybrids, with drafts made, some accepted and some rejected; a
rejected token never reaches the prefix cache nor a KV event.

A random model's output rarely repeats, so drafts would all fail: `narrow_head` keeps four
rows of its output head (the others zero), so that its tokens come from a small alphabet
and repeat in patterns that prompt lookup finds, while each token still depends on the
whole context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.kv.events import BlocksStored  # noqa: E402
from hybridkv.kv.request import KVRequest  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

ALPHABET = [40, 41, 42, 43]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
PROMPTS = [ALPHABET * 4, [7, 8, 9, 10] * 6, [40, 42] * 5 + [3, 5, 41]]


def narrow_head(model_dir: Path) -> Path:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    # A tied head narrows the embedding too: the other tokens then enter as zeros.
    [name] = [n for n in ("lm_head.weight", "head.weight") if n in tensors] or \
        [n for n in tensors if n.endswith("embed_tokens.weight")]
    head = tensors[name]
    keep = head[ALPHABET].clone()
    head.zero_()
    head[ALPHABET] = keep
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


def tiny(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return narrow_head(build_tiny_model(name, tmp_path_factory.mktemp(name)))


def engine(model_dir: Path, **options: object) -> LLM:
    common: dict[str, object] = dict(dtype="float32", max_model_len=256,
                                     kv_cache_memory="16MiB")
    return LLM(str(model_dir), **{**common, **options})


def check_equal_with_drafts(model_dir: Path, prompts: list[list[int]] = PROMPTS,
                            **options: object) -> list:
    plain = engine(model_dir, **options).generate(prompts, GREEDY)
    spec_llm = engine(model_dir, speculative_config=NGRAM, **options)
    spec = spec_llm.generate(prompts, GREEDY)
    for p, s in zip(plain, spec, strict=True):
        assert s.token_ids == p.token_ids
        assert p.num_draft_tokens == p.num_accepted_tokens == 0
    drafts = sum(s.num_draft_tokens for s in spec)
    accepted = sum(s.num_accepted_tokens for s in spec)
    assert 0 < accepted < drafts, (accepted, drafts)  # some kept, some rejected
    spec_llm.engine.kv_manager.check_integrity()
    return spec


# (KV sharing: gemma3n in test_with_int8_pages_an_offload_tier_and_fast_prefill.)
ATTENTION = ["llama", "qwen3_swa", "gemma3", "llama4_text"]
# Mamba2 + attention, Mamba1 alone, a short convolution, Gated DeltaNet, RG-LRU beside
# sliding windows, lightning attention, RWKV, mLSTM, DeepSeek-V4's compressor states.
STATE = ["nemotron_h", "mamba", "lfm2", "qwen3_5_text", "recurrent_gemma", "minimax", "rwkv",
         "xlstm", "deepseek_v4"]


@pytest.mark.parametrize("name", ATTENTION)
def test_greedy_equal_on_attention_families(name, tmp_path_factory):
    check_equal_with_drafts(tiny(name, tmp_path_factory))


@pytest.mark.parametrize("name", STATE)
def test_greedy_equal_on_state_families(name, tmp_path_factory):
    check_equal_with_drafts(tiny(name, tmp_path_factory))


@pytest.mark.parametrize("name, options", [
    ("llama", {"kv_cache_dtype": "int8"}),
    ("llama", {"kv_offload_cpu": "8MiB"}),
    ("gemma3n", {"kv_sharing_fast_prefill": True}),
    ("nemotron_h", {"kv_offload_cpu": "8MiB"}),
])
def test_with_int8_pages_an_offload_tier_and_fast_prefill(name, options, tmp_path_factory):
    check_equal_with_drafts(tiny(name, tmp_path_factory), **options)


@pytest.fixture(scope="module", params=["llama", "nemotron_h"])
def model_dir(request, tmp_path_factory):
    return tiny(request.param, tmp_path_factory)


def test_with_prefix_hits_chunked_prefill_and_preemption(model_dir):
    # Prompts sharing a 32-token prefix (hits), 24-token steps (chunked prefill) and a
    # cache too small for all of them at once (preemption).
    shared = ALPHABET * 8
    prompts = [shared + [7, 8, 9] * i for i in range(1, 5)]
    spec = check_equal_with_drafts(model_dir, prompts, max_num_batched_tokens=24,
                                   kv_cache_memory="1MiB", max_model_len=128)
    assert sum(s.num_cached_tokens for s in spec) > 0


def test_requests_that_cannot_draft_run_beside_drafting_ones(model_dir):
    # Penalties and logprobs draft nothing; their tokens stay the same while greedy
    # requests in the same steps score drafts.
    params = [GREEDY, SamplingParams(max_tokens=20, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, logprobs=2)]
    plain = engine(model_dir).generate(PROMPTS, params)
    spec = engine(model_dir, speculative_config=NGRAM).generate(PROMPTS, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert spec[0].num_draft_tokens > 0
    assert spec[1].num_draft_tokens == spec[2].num_draft_tokens == 0
    # Equal to float32 rounding: the steps' other rows differ (a state model's batched
    # decode is not bitwise batch-invariant, with or without drafts).
    for got, want in zip(spec[2].logprobs, plain[2].logprobs, strict=True):
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5)


def test_greedy_with_a_logit_bias_drafts_and_stays_equal(model_dir):
    params = SamplingParams(max_tokens=32, ignore_eos=True, logit_bias={41: 0.5, 7: 2.0})
    plain = engine(model_dir).generate(PROMPTS, params)
    spec = engine(model_dir, speculative_config=NGRAM).generate(PROMPTS, params)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert 0 < sum(s.num_accepted_tokens for s in spec) < sum(s.num_draft_tokens for s in spec)


def test_stops_inside_accepted_drafts_end_where_they_would(model_dir):
    [free] = engine(model_dir).generate(PROMPTS[1], GREEDY)
    stop_at = free.token_ids[20]
    llm = engine(model_dir, speculative_config=NGRAM)
    expected = free.token_ids[:free.token_ids.index(stop_at) + 1]
    [out] = llm.generate(PROMPTS[1], SamplingParams(max_tokens=32, ignore_eos=True,
                                                    stop_token_ids=[stop_at]))
    assert out.token_ids == expected
    for n in (1, 7, 30):
        [out] = llm.generate(PROMPTS[1], SamplingParams(max_tokens=n, ignore_eos=True))
        assert out.token_ids == free.token_ids[:n]


def test_streamed_tokens_add_up_to_the_output(model_dir):
    llm = engine(model_dir, speculative_config=NGRAM)
    llm.engine.add_request("r", PROMPTS[1], GREEDY)
    streamed: list[int] = []
    multi = 0
    while llm.engine.has_unfinished:
        for out in llm.engine.step():
            streamed += out.new_token_ids
            multi += len(out.new_token_ids) > 1
    assert streamed == out.token_ids and len(streamed) == GREEDY.max_tokens
    assert multi > 0  # some steps brought accepted drafts with their token


def test_rejected_tokens_never_reach_the_prefix_cache_or_kv_events(model_dir):
    llm = engine(model_dir, speculative_config=NGRAM)
    manager = llm.engine.kv_manager
    manager.pool.kv_events = []
    outputs = llm.generate(PROMPTS, GREEDY)
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in outputs) > 0
    # Every block hash any prefix of a finished sequence can have: a block holding a
    # rejected draft would hash a sequence nobody produced.
    valid = set()
    for out in outputs:
        seq = KVRequest("x", out.prompt_token_ids + out.token_ids,
                        hash_block_size=llm.engine.plan.config.hash_block_size,
                        block_hasher=manager.block_hasher)
        valid.update(seq.block_hashes)
    stored = [h for e in manager.pool.kv_events if isinstance(e, BlocksStored)
              for h in e.block_hashes]
    assert stored and set(stored) <= valid
    for m in manager.managers:
        assert set(m.cached) <= valid


def test_speculative_config_errors_name_the_option(tmp_path_factory):
    model_dir = build_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    with pytest.raises(ValueError, match="speculative_config method 'eagle9' is unknown"):
        engine(model_dir, speculative_config={"method": "eagle9"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        engine(model_dir, speculative_config={"method": "ngram",
                                              "num_speculative_tokens": 0})


def test_spec_counters_on_metrics():
    pytest.importorskip("prometheus_client")
    from hybridkv.engine.outputs import RequestOutput
    from hybridkv.server.async_engine import EngineSnapshot, RequestStream
    from hybridkv.server.metrics import ServerMetrics

    metrics = ServerMetrics("m", EngineSnapshot, [])
    stream = RequestStream("r", 4)
    for drafts, accepted, new in ((0, 0, [5]), (3, 2, [6, 7, 8]), (6, 2, [9]),
                                  (9, 5, [1, 2, 3, 4])):
        metrics.observe_output(stream, RequestOutput(
            "r", [1, 2, 3, 4], [], "", False, new_token_ids=new,
            num_draft_tokens=drafts, num_accepted_tokens=accepted))
    text = metrics.render().decode()

    def value(series: str) -> float:
        [line] = [x for x in text.splitlines() if x.startswith(series + " ")]
        return float(line.split()[-1])

    assert value('vllm:spec_decode_num_drafts_total{model_name="m"}') == 3
    assert value('vllm:spec_decode_num_draft_tokens_total{model_name="m"}') == 9
    assert value('vllm:spec_decode_num_accepted_tokens_total{model_name="m"}') == 5
    per_pos = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="%d"}'
    assert [value(per_pos % i) for i in range(3)] == [2, 2, 1]


def test_cli_speculative_config(tmp_path, capsys):
    from hybridkv.cli import main
    from hybridkv.models.demo import demo_shape, write_demo_model

    model = str(write_demo_model(tmp_path / "demo", "llama", demo_shape("small", layers=2)))
    assert main(["generate", model, "--prompt", "a", "--speculative-config", "{bad"]) != 0
    assert "--speculative-config: not JSON" in capsys.readouterr().err
    assert main(["generate", model, "--prompt", "a", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 0}']) != 0
    assert "num_speculative_tokens must be an integer in [1, 64]" in capsys.readouterr().err
    args = ["generate", model, "--prompt", "one two one two one two", "--max-tokens", "12",
            "--json", "--kv-cache-memory", "16MiB", "--max-model-len", "128"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--speculative-config", '{"method": "ngram"}']) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
