"""Building an engine from a model directory, kept apart from running one: read the config,
load the model and tokenizer, plan the KV cache, create the manager, scheduler and runner.
`LLMEngine` takes the finished parts, so tests can hand it a fake runner."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from hybridkv.config import EngineConfig
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.plan import KVCachePlan, plan_kv_cache
from hybridkv.models.layer_mix import kv_layout_from_config
from hybridkv.models.loader import load_model, read_config
from hybridkv.sched.scheduler import Scheduler, SchedulerOutput
from hybridkv.worker.kv_cache import torch_dtype
from hybridkv.worker.model_runner import ModelRunner, RunnerOutput


class Runner(Protocol):
    """What the engine needs of a model runner."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


@dataclass
class EngineParts:
    scheduler: Scheduler  # holds the KV cache manager
    runner: Runner
    plan: KVCachePlan
    max_model_len: int
    vocab_size: int
    tokenizer: Any | None = None  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...] = ()


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def build_engine(model_dir: str, config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    hf_config = read_config(Path(model_dir))
    text_cfg = hf_config.get("text_config") or hf_config
    dtype_name = config.dtype if config.dtype != "auto" else str(
        text_cfg.get("torch_dtype") or hf_config.get("torch_dtype")
        or hf_config.get("dtype") or "float32")
    dtype = torch_dtype(dtype_name)
    loaded = load_model(model_dir, dtype=dtype, device=device, config=hf_config)
    max_pos = text_cfg.get("max_position_embeddings") or 8192
    max_model_len = config.max_model_len or min(int(max_pos), 8192)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                         f"({config.max_num_batched_tokens}) must be >= max_model_len "
                         f"({max_model_len})")
    layout = kv_layout_from_config(hf_config, block_size=config.block_size,
                                   kv_dtype=dtype_name)
    plan = plan_kv_cache(layout.layer_specs, int(config.kv_cache_memory),
                         max_model_len=max_model_len,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         hybrid=not config.disable_hybrid_kv_cache,
                         kv_sharing=layout.kv_sharing)
    if config.kv_sharing_fast_prefill and getattr(loaded.model, "kv_shared_from",
                                                  None) is None:
        raise ValueError(
            f"kv_sharing_fast_prefill needs a model whose last layers only read other "
            f"layers' KV (num_kv_shared_layers or kv_sharing_target_layers in config.json"
            f"); {layout.model_type} at {model_dir} has none")
    kv_manager = KVCacheManager(plan.config, max_model_len=max_model_len,
                                **config.cache_options())
    scheduler = Scheduler(config.scheduler_config(max_model_len), kv_manager)
    runner = ModelRunner(loaded.model, plan.config,
                         config.runner_config(max_model_len, device))
    return EngineParts(scheduler=scheduler, runner=runner, plan=plan,
                       max_model_len=max_model_len, vocab_size=int(text_cfg["vocab_size"]),
                       tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids)
