"""The catalogue of bad inputs a new user sends: through the Python API, engine options,
malformed model directories and the command line. Each must be refused with one line that
names what was wrong, and the engine must serve a good request right after."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.cli import main  # noqa: E402
from hybridkv.models.demo import train_tokenizer  # noqa: E402
from tests.models.tiny import build_tiny_model  # noqa: E402

OPTIONS = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": "16MiB"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"))
    train_tokenizer(path, vocab_size=256)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **OPTIONS)


@pytest.fixture(scope="module")
def expected(llm):
    return llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids


def one_line(error: BaseException | str) -> str:
    text = str(error)
    assert text and "\n" not in text.strip() and "Traceback" not in text, text
    return text


def served(llm, expected):
    """A good request after a bad one: answered, and the same as before."""
    assert not llm.engine.scheduler.has_unfinished
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert out.token_ids == expected and out.finish_reason == "length"


# ---------------------------------------------------------------- the Python API
SAMPLING = [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": -2}, "top_k"),  # -1: vLLM's "all tokens" (test_vllm_compat.py)
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"logprobs": 2.5}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": [5]}, "stop"),
    ({"stop": b"x"}, "stop"),
    ({"stop": [""]}, "stop strings"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"seed": 2**70, "temperature": 0.5}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"temprature": 0.5}, "unknown sampling field"),
    # A penalty a float32 logit overflows with: refused here, not "probability tensor
    # contains inf" inside the step.
    ({"repetition_penalty": 1e-45, "temperature": 1.0}, "repetition_penalty must be in [0.0001"),
    ({"repetition_penalty": 5e-324, "temperature": 1.0}, "repetition_penalty must be in"),
    ({"repetition_penalty": 1e38, "temperature": 1.0}, "repetition_penalty must be in"),
    ({"repetition_penalty": 1e38}, "10000]"),
]


@pytest.mark.parametrize("fields, named", SAMPLING, ids=[str(f) for f, _ in SAMPLING])
def test_bad_sampling_params(llm, expected, fields, named):
    with pytest.raises(ValueError) as e:
        llm.generate([[5, 6], [7, 8]], [SamplingParams(), fields])
    assert named in one_line(e.value)
    served(llm, expected)


# Extremes that are accepted must sample: a token, never an error inside the step.
EXTREMES = [
    {"top_p": 5e-324}, {"top_p": 1e-45}, {"min_p": 5e-324}, {"min_p": 1.0},
    {"temperature": 1e38}, {"temperature": 1.7e308}, {"temperature": 1e-45},
    {"temperature": 1e-5}, {"temperature": 2e-5, "top_k": 1},
    {"repetition_penalty": 1e-4}, {"repetition_penalty": 1e4},
    {"presence_penalty": 5e-324}, {"presence_penalty": -2.0}, {"frequency_penalty": 2.0},
    {"frequency_penalty": -1e-45}, {"logit_bias": {5: 1e-45, 6: 100.0, 7: -100.0}},
    {"logit_bias": {t: -100.0 for t in range(256)}},
    {"logit_bias": {t: 100.0 for t in range(256)}, "repetition_penalty": 1e4},
]


@pytest.mark.parametrize("fields", EXTREMES, ids=[str(f)[:40] for f in EXTREMES])
def test_accepted_extremes_sample(llm, expected, fields):
    params = SamplingParams(**{"temperature": 1.0, "seed": 0, "max_tokens": 4, **fields})
    [out] = llm.generate([[5, 6, 7, 5, 6]], params)
    assert out.finish_reason in ("length", "stop"), out.error
    served(llm, expected)


GENERATE = [
    (([[5.7, 6, 7]],), "token 0 of the prompt is 5.7"),
    ((b"abc",), "bytes"),
    ((["hi", 5],), "prompt 1"),
    ((["hi", None],), "prompt 1"),
    (([[]],), "the prompt is empty"),
    (([[5, 999999]],), "outside the vocabulary"),
    (([[5, -1]],), "outside the vocabulary"),
    (([[True, 5]],), "token 0 of the prompt is True"),
    (([[5] * 200],), "max_model_len is 128"),
    ((5,), "prompts must be"),
    (({"prompt": "hi"},), "prompts must be"),
    ((["hi"], {"temperature": -1}), "temperature"),
    ((["hi"], "greedy"), "sampling_params must be"),
    ((["hi", "there"], [SamplingParams()]), "1 sampling params for 2 prompts"),
]


@pytest.mark.parametrize("args, named", GENERATE, ids=[repr(a)[:40] for a, _ in GENERATE])
def test_bad_generate_arguments(llm, expected, args, named):
    with pytest.raises(ValueError) as e:
        llm.generate(*args)
    assert named in one_line(e.value)
    served(llm, expected)


def test_array_prompts_name_the_fix(llm, expected):
    np = pytest.importorskip("numpy")
    for prompts in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.array([5, 6])]):
        with pytest.raises(ValueError) as e:
            llm.generate(prompts)
        assert ".tolist()" in one_line(e.value)
    served(llm, expected)


def test_bad_keyword_arguments(llm, expected):
    for kwargs, named in [({"priority": [1.5]}, "priority"), ({"priority": 3}, "priority"),
                          ({"use_tqdm": "no"}, "use_tqdm")]:
        with pytest.raises(ValueError) as e:
            llm.generate(["hi"], **kwargs)
        assert named in one_line(e.value)
    served(llm, expected)


# ---------------------------------------------------------------- engine options
ENGINE = [
    ({"kv_cache_memory": "abc"}, "'abc' as a memory size"),
    ({"kv_cache_memory": 0}, "kv_cache_memory"),
    ({"kv_cache_memory": [1]}, "kv_cache_memory"),
    ({"kv_cache_memory": "1TiB"}, "more than cpu has available"),
    ({"enable_prefix_caching": "false"}, "enable_prefix_caching"),
    ({"enable_chunked_prefill": 1}, "enable_chunked_prefill"),
    ({"mamba_checkpoint_interval": -3}, "mamba_checkpoint_interval"),
    ({"mamba_checkpoint_tail": 0}, "mamba_checkpoint_tail must be an integer >= 1"),
    ({"max_model_len": "1024"}, "max_model_len"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_model_len": 4096}, "max_position_embeddings (512)"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens"),
    ({"block_size": -16}, "block_size"),
    ({"kernel_block_size": 5}, "must divide"),
    ({"device": "tpu"}, "device must be one of"),
    ({"dtype": "int4"}, "dtype 'int4'"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"kv_eviction": "random"}, "kv_eviction"),
    ({"attention_backend": "flash"}, "attention backend"),
    ({"block_hash_algo": "md5"}, "block_hash_algo"),
    ({"linear_kernel": "mkl"}, "linear_kernel"),
    ({"linear_kernel": "onednn", "dtype": "fp16"}, "linear_kernel 'onednn' needs"),
    ({"max_batch": 3}, "unknown engine option"),
    ({"kv_sharing_fast_prefill": True}, "kv_sharing_fast_prefill needs"),
    ({"kv_offload_cpu": "1TiB"}, "kv_offload_cpu 1.00 TiB is more than the host has available"),
    # Options that would change nothing are refused, naming the option and what applies.
    ({"kv_cache_dtype": "int8", "kv_cache_dtype_skip": "full,sliding"},
     "keeps every attention layer of this model (full, sliding_window) in the model's dtype, "
     "so kv_cache_dtype 'int8' would quantize nothing"),
    ({"state_dtype": "bf16"}, "state_dtype (--state-dtype) 'bf16' sets the dtype of recurrent "
     "states (Mamba, linear attention), and this model has none"),
    ({"kv_events_queue": 100}, "kv_events_queue (--kv-events-queue) applies to published KV "
     "events; set kv_events_endpoint (--kv-events-endpoint) too"),
    ({"kv_events_topic": ""}, "kv_events_topic (--kv-events-topic) applies to published"),
    ({"kv_events_replay_endpoint": "tcp://*:5999"}, "kv_events_replay_endpoint"),
]


@pytest.mark.parametrize("options, named", ENGINE, ids=[str(o) for o, _ in ENGINE])
def test_bad_engine_options(model_dir, llm, expected, options, named):
    with pytest.raises(ValueError) as e:
        LLM(str(model_dir), **{**OPTIONS, **options})
    assert named in one_line(e.value)
    served(llm, expected)


def test_a_long_max_model_len_needs_the_override(model_dir):
    LLM(str(model_dir), **{**OPTIONS, "max_model_len": 1024, "allow_long_max_model_len": True})


def test_the_model_dir_must_be_a_path(llm, expected):
    with pytest.raises(ValueError) as e:
        LLM(123)
    assert "model_dir must be a path" in one_line(e.value)
    served(llm, expected)


# ---------------------------------------------------------------- model directories
def _config_without(field):
    def edit(config):
        del config[field]
        return config
    return edit


def _set(**fields):
    def edit(config):
        config.update(fields)
        return config
    return edit


CONFIGS = [
    (_config_without("hidden_size"), "hidden_size is missing"),
    (_config_without("num_attention_heads"), "num_attention_heads is missing"),
    (_config_without("vocab_size"), "vocab_size is missing"),
    (_config_without("intermediate_size"), "intermediate_size is missing"),
    (_config_without("num_hidden_layers"), "num_hidden_layers is missing"),
    (lambda config: [config], "expected a JSON object, got list"),
    (_set(layer_types=["sliding_attention"] * 3), "layer_types has 3 entries"),
    (_set(hidden_size="one hundred"), "hidden_size must be a positive integer"),
    (_set(num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
    (_set(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
    (_set(model_type="bert"), "model_type='bert'"),
]


@pytest.mark.parametrize("edit, named", CONFIGS, ids=[n for _, n in CONFIGS])
def test_malformed_config_json(model_dir, llm, expected, tmp_path, edit, named):
    broken = _copy(model_dir, tmp_path)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ValueError) as e:
        LLM(str(broken), **OPTIONS)
    message = one_line(e.value)
    assert named in message
    if "model_type" not in named:
        assert "config.json" in message
    served(llm, expected)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _int32_weights(path: Path) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(path))


FILES = [
    ("model.safetensors", _truncate, "model.safetensors: not a readable safetensors"),
    ("model.safetensors", lambda p: p.write_bytes(b""), "model.safetensors: not a readable"),
    ("model.safetensors", lambda p: p.write_bytes(b"\x07garbage" * 40), "model.safetensors"),
    ("model.safetensors", _int32_weights, "torch.int32"),
    ("tokenizer.json", lambda p: p.write_text("{not json"), "tokenizer.json: not a readable"),
    ("generation_config.json", lambda p: p.write_text("{bad"), "generation_config.json: invalid"),
    ("generation_config.json", lambda p: p.write_text('{"eos_token_id": "x"}'),
     "eos_token_id must be a token id"),
    ("config.json", lambda p: p.write_text("{bad"), "config.json: invalid JSON"),
    ("config.json", lambda p: p.write_bytes(b"\xff\xfe{}"), "config.json: not UTF-8"),
    ("config.json", lambda p: p.unlink(), "missing config.json"),
    ("model.safetensors", lambda p: p.unlink(), "missing model.safetensors"),
]


@pytest.mark.parametrize("name, breaks, named", FILES, ids=[n for _, _, n in FILES])
def test_broken_model_files(model_dir, llm, expected, tmp_path, name, breaks, named):
    broken = _copy(model_dir, tmp_path)
    if not (broken / name).exists():
        (broken / name).write_text("{}")
    breaks(broken / name)
    with pytest.raises(ValueError) as e:
        LLM(str(broken), **OPTIONS)
    assert named in one_line(e.value)
    served(llm, expected)


def test_a_sharded_index_without_weight_map(model_dir, llm, expected, tmp_path):
    broken = _copy(model_dir, tmp_path)
    (broken / "model.safetensors").rename(broken / "model-00001-of-00001.safetensors")
    (broken / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError) as e:
        LLM(str(broken), **OPTIONS)
    assert "model.safetensors.index.json: no weight_map" in one_line(e.value)
    served(llm, expected)


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


# ---------------------------------------------------------------- the command line
CLI = [
    (["generate", "{model}", "--prompt", "hi", "--temperature", "nan"], "temperature"),
    (["generate", "{model}", "--prompt", "hi", "--seed", str(2**70)], "seed"),
    (["generate", "{model}", "--prompt", "hi", "--kv-cache-memory", "abc"], "abc"),
    (["generate", "{model}", "--prompt", "hi", "--max-tokens", "0"], "max-tokens"),
    (["generate", "{model}", "--prompt", "hi", "--kv-cache-memory", "1TiB"],
     "kv_cache_memory"),
    (["generate", "{model}", "--prompt", "hi", "--max-model-len", "100000"],
     "max_position_embeddings"),
    (["generate", "{model}", "--prompts-file", "{binary}"], "prompts.bin"),
    (["generate", "{model}", "--prompts-file", "{missing}"], "nothing.txt"),
    (["generate", "{missing_dir}", "--prompt", "hi"], "no-such-model"),
    (["plan", "{list_config}"], "expected a JSON object"),
    (["plan", "{short_layers}"], "layer_types has 3 entries"),
    (["plan", "no-such-model-name"], "no-such-model-name"),
    (["demo-model", "{out}", "--heads", "3", "--kv-heads", "2"], "heads"),
    (["bench", "kv", "--num-requests", "0"], "num-requests"),
    # A negative size is a value to refuse, not an option argparse does not know.
    (["plan", "--memory", "-5GiB"], "memory size must be positive, like 40GiB"),
    (["plan", "--memory=-5GiB"], "memory size must be positive, like 40GiB"),
    (["plan", "--memory", "0"], "memory size must be positive"),
    (["plan", "--kv-offload-cpu", "-1GiB"], "memory size must be positive"),
    (["generate", "{model}", "--prompt", "hi", "--kv-cache-memory", "-5MiB"],
     "memory size must be positive"),
    (["generate", "{model}", "--prompt", "hi", "--kv-offload-cpu", "-8GiB"],
     "memory size must be positive"),
    (["generate", "{model}", "--prompt", "hi", "--kv-offload-cpu", "1TiB"],
     "kv_offload_cpu 1.00 TiB is more than the host has available"),
    (["bench", "kv", "--memory", "-1.5GiB"], "memory size must be positive"),
    (["bench", "capacity", "--kv-cache-memory", "-1"], "memory size must be positive"),
    (["generate", "{model}", "--prompt", "hi", "--kv-offload-disk", "{seed_dir}:64MiB"],
     "hybridkv-hash-seed is not UTF-8 text; it should hold one line"),
    (["generate", "{model}", "--prompt", "hi", "--state-dtype", "bf16"], "has none"),
    (["plan", "{model}", "--kv-cache-dtype", "q4", "--kv-cache-dtype-skip", "sliding,full"],
     "would quantize nothing"),
    (["serve", "{model}", "--kv-events-queue", "100"], "kv_events_queue (--kv-events-queue)"),
    # Refused by the launcher, before any replica starts.
    (["serve", "{model}", "--data-parallel-size", "2", "--kv-events-topic", "t"],
     "kv_events_topic (--kv-events-topic) applies to published KV events"),
]


@pytest.mark.parametrize("argv, named", CLI, ids=[" ".join(a[:3] + a[3:5]) for a, _ in CLI])
def test_bad_command_lines(model_dir, llm, expected, tmp_path, capsys, argv, named):
    (tmp_path / "prompts.bin").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "list.json").write_text("[1, 2]")
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_types"] = config["layer_types"][:3]
    (tmp_path / "short.json").write_text(json.dumps(config))
    paths = {"model": str(model_dir), "binary": str(tmp_path / "prompts.bin"),
             "missing": str(tmp_path / "nothing.txt"),
             "missing_dir": str(tmp_path / "no-such-model"),
             "list_config": str(tmp_path / "list.json"),
             "short_layers": str(tmp_path / "short.json"), "out": str(tmp_path / "demo"),
             "seed_dir": str(_garbage_seed(tmp_path / "kv"))}
    capsys.readouterr()
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err
    assert named in one_line(err) and "error" in err
    served(llm, expected)


# ---------------------------------------------------------------- a disk tier's directory
def _garbage_seed(directory: Path, content: bytes = b"\xff\xfe\x00garbage") -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "hybridkv-hash-seed").write_bytes(content)
    return directory


@pytest.mark.parametrize("content, named", [
    (b"\xff\xfe\x00garbage", "is not UTF-8 text"), (b"", "is empty"), (b" \n", "is empty")],
    ids=["garbage", "empty", "blank"])
def test_a_bad_hash_seed_file_names_itself(model_dir, llm, expected, tmp_path, content, named):
    directory = _garbage_seed(tmp_path / "kv", content)
    with pytest.raises(ValueError) as e:
        LLM(str(model_dir), **OPTIONS, kv_offload_disk=f"{directory}:64MiB")
    message = one_line(e.value)
    assert f"hash seed file {directory / 'hybridkv-hash-seed'} {named}" in message
    assert "it should hold one line of text, the block hash seed" in message
    served(llm, expected)
