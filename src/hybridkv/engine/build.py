"""Building an engine from a model directory, kept apart from running one: read the config,
load the model and tokenizer, plan the KV cache, create the manager, scheduler and runner.
`LLMEngine` takes the finished parts, so tests can hand it a fake runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from hybridkv.config import EngineConfig
from hybridkv.connector.canonical import canonical_kv_caches
from hybridkv.connector.scheduler import OffloadConnectorScheduler
from hybridkv.connector.worker import OffloadConnectorWorker
from hybridkv.engine.draft import DraftParts, load_draft
from hybridkv.engine.mtp import load_mtp
from hybridkv.engine.offload import (
    block_hash_seed,
    build_tier_chain,
    layout_fingerprint,
    model_identity,
)
from hybridkv.engine.weight_memory import describe, weight_memory
from hybridkv.kv.cache_dtype import apply_cache_dtype
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.plan import KVCachePlan, format_bytes, memory_for_requests, plan_kv_cache
from hybridkv.kv.spec import with_speculative_states
from hybridkv.models.formats.gguf_config import config_from_gguf
from hybridkv.models.formats.gguf_file import read_header
from hybridkv.models.formats.loader import (
    LoadedModel,
    load_gguf_model,
    load_model,
    read_config,
)
from hybridkv.models.layer_mix import kv_layout_from_config
from hybridkv.models.native_decode import attach as attach_native_decode
from hybridkv.models.sources import resolve_model
from hybridkv.sched.scheduler import Scheduler, SchedulerOutput
from hybridkv.worker.attention.cpu import choose_backend
from hybridkv.worker.cpu_malloc import keep_buffers_in_heap, release_free_memory
from hybridkv.worker.cpu_ops import use_cpu_ops
from hybridkv.worker.kv_cache import torch_dtype
from hybridkv.worker.linear.quantized import QuantizedParts
from hybridkv.worker.model_runner import ModelRunner, RunnerOutput
from hybridkv.worker.threads import set_intra_op_threads

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine needs of a model runner."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...


@dataclass
class EngineParts:
    scheduler: Scheduler  # holds the KV cache manager
    runner: Runner
    plan: KVCachePlan
    max_model_len: int
    vocab_size: int  # the token ids a step can sample: the logits' width
    tokenizer: Any | None = None  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...] = ()
    # What a chat endpoint needs when the model is one file (GGUF): its template and the
    # special tokens templates print. A directory's are read from its files by the server.
    chat_template: str | None = None
    special_tokens: dict[str, str] | None = None
    # The token ids a prompt may hold (the embedding's rows), where more than vocab_size: a
    # head cut short of a padded embedding (Inkling 2's unpadded_vocab_size).
    input_vocab_size: int | None = None


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but this torch build sees no CUDA "
                             f"device; use device='cpu' or 'auto'")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA "
                             f"device(s) here")
    return name


def available_memory(device: str) -> int | None:
    """Bytes the KV cache could still get on `device` (None: unknown). On the CPU, what the
    kernel reports as available (free + reclaimable), not the machine's total."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory_budget(kv_cache_memory: int, device: str) -> None:
    """Refuse at once a KV budget the device cannot hold, before anything is allocated."""
    available = available_memory(device)
    if available is not None and kv_cache_memory > available:
        raise ValueError(f"kv_cache_memory {format_bytes(kv_cache_memory)} is more than "
                         f"{device} has available ({format_bytes(available)}); lower "
                         f"kv_cache_memory")


# Without a kv_cache_memory, the KV cache gets what max_num_seqs requests of max_model_len
# need (the planner's `memory_for_requests`), never more than this share of the memory the
# device has available once the model is loaded, nor more than AUTO_KV_CAP on the CPU. Not
# a share of memory outright: the arena's pages are backed by memory once written, and a
# server's distinct prompts write fresh ones, so its resident memory would climb toward any
# budget it was given (and a host runs more than one engine).
AUTO_KV_FRACTION = {"cpu": 0.5, "cuda": 0.9}
AUTO_KV_CAP = 16 << 30


def kv_memory_cap(device: str) -> tuple[int, str]:
    """(the most a default KV budget may take on `device`, what that is in words)."""
    available = available_memory(device)
    if available is None:
        return 1 << 30, "1 GiB (the device's free memory is unknown)"
    if device.startswith("cuda"):
        return int(available * AUTO_KV_FRACTION["cuda"]), "90% of the free device memory"
    half = int(available * AUTO_KV_FRACTION["cpu"])
    if half > AUTO_KV_CAP:
        return AUTO_KV_CAP, f"the CPU cap of {format_bytes(AUTO_KV_CAP)}"
    return half, "half the available memory"


def default_kv_cache_memory(layout: Any, config: EngineConfig, max_model_len: int,
                            device: str) -> int:
    """The KV budget without a kv_cache_memory, stated in one logged line."""
    need = memory_for_requests(
        layout.layer_specs, config.max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        hybrid=not config.disable_hybrid_kv_cache, kv_sharing=layout.kv_sharing,
        enable_caching=config.enable_prefix_caching,
        checkpoint_interval=config.mamba_checkpoint_interval,
        checkpoint_tail=config.mamba_checkpoint_tail)
    cap, cap_text = kv_memory_cap(device)
    tokens = (f"{config.max_num_seqs * max_model_len:,} tokens = max_model_len "
              f"{max_model_len} x max_num_seqs {config.max_num_seqs}")
    if need <= cap:
        logger.info("KV cache memory %s, for %s (set kv_cache_memory / --kv-cache-memory "
                    "to choose another size)", format_bytes(need), tokens)
        return need
    logger.info("KV cache memory %s, %s: %s would need %s (set kv_cache_memory / "
                "--kv-cache-memory to choose, or lower max_num_seqs or max_model_len)",
                format_bytes(cap), cap_text, tokens, format_bytes(need))
    return cap


def _load(model: str, config: EngineConfig, device: str
          ) -> tuple[LoadedModel, dict[str, Any], str]:
    """(the loaded model, its HF config, its dtype name)."""
    source = resolve_model(model)
    if source.is_gguf:
        from hybridkv.worker.linear import quant as quant_linear

        quant_linear.set_float_activations(config.quant_activations == "float32")
        header = read_header(source.path)
        hf_config = config_from_gguf(header)
        dtype_name = config.dtype if config.dtype != "auto" else "float32"
        loaded = load_gguf_model(header, hf_config, device=device,
                                 dtype=torch_dtype(dtype_name),
                                 linear_kernel=config.linear_kernel,
                                 dequantize=config.dequantize)
        return loaded, hf_config, dtype_name
    if config.dequantize:
        raise ValueError(f"dequantize applies to GGUF models; {model} is a Hugging Face "
                         f"directory")
    hf_config = read_config(source.path)
    text_cfg = hf_config.get("text_config") or hf_config
    dtype_name = config.dtype if config.dtype != "auto" else str(
        text_cfg.get("torch_dtype") or hf_config.get("torch_dtype")
        or hf_config.get("dtype") or "float32")
    loaded = load_model(source.path, dtype=torch_dtype(dtype_name), device=device,
                        config=hf_config, linear_kernel=config.linear_kernel)
    return loaded, hf_config, dtype_name


def _fitting_len(layout: Any, budget: int, wanted: int, config: EngineConfig) -> int:
    """The longest max_model_len up to `wanted` whose one request fits `budget` (0: none)."""
    def fits(n: int) -> bool:
        try:
            plan_kv_cache(layout.layer_specs, budget, max_model_len=n,
                          max_num_batched_tokens=config.max_num_batched_tokens,
                          hybrid=not config.disable_hybrid_kv_cache,
                          kv_sharing=layout.kv_sharing,
                          enable_caching=config.enable_prefix_caching,
                          checkpoint_interval=config.mamba_checkpoint_interval,
                          checkpoint_tail=config.mamba_checkpoint_tail)
            return True
        except ValueError:
            return False

    if fits(wanted):
        return wanted
    low, high = 0, wanted
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _use_cpu_kernels(model: Any, config: EngineConfig, device: str) -> None:
    if choose_backend(config.attention_backend, device) == "cpu":
        use_cpu_ops(model)  # the C norms and RoPE that go with the C attention
        if any(isinstance(m, QuantizedParts) for m in model.modules()):
            unfit = attach_native_decode(model)
            if unfit is not None:
                logger.info("decode steps run layer by layer: %s", unfit)


def _draft(config: EngineConfig, device: str, dtype_name: str, vocab_size: int,
           tokenizer: Any | None, mtp_of: tuple[str, LoadedModel, dict[str, Any], Any]
           ) -> DraftParts | None:
    """The draft model of speculative_config method draft_model, or the MTP head of method
    mtp (`mtp_of`: the target's path, loaded model, HF config and KV layout); None for
    other methods."""
    spec = config.speculative
    if spec is None or not spec.drafts_in_worker:
        return None
    if spec.method == "mtp":
        model_dir, loaded, hf_config, layout = mtp_of
        head = load_mtp(model_dir, loaded, hf_config, layout.layer_specs,
                        kv_cache_dtype=config.kv_cache_dtype, dtype=torch_dtype(dtype_name),
                        device=device, linear_kernel=config.linear_kernel,
                        dequantize=config.dequantize)
        if choose_backend(config.attention_backend, device) == "cpu":
            use_cpu_ops(head.model)  # its norms and RoPE as the target's
        return head
    # In the target's dtype: its K/V are written into pages of that dtype.
    same_dtype = replace(config, dtype=dtype_name)
    draft = load_draft(spec, lambda name: _load(name, same_dtype, device),
                       block_size=config.block_size, kv_dtype=dtype_name,
                       kv_cache_dtype=config.kv_cache_dtype, vocab_size=vocab_size,
                       tokenizer=tokenizer)
    _use_cpu_kernels(draft.model, config, device)
    return draft


def build_engine(model_dir: str, config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    if config.kv_cache_memory is not None:
        check_memory_budget(int(config.kv_cache_memory), device)
    # Before any torch work: the thread pool is sized once, on purpose (worker/threads.py).
    set_intra_op_threads(config.threads)
    loaded, hf_config, dtype_name = _load(model_dir, config, device)
    if device == "cpu":
        release_free_memory()  # what loading freed (a tokenizer's build, read buffers)
        # From here, activations reuse heap buffers, not fresh pages (see module). Not
        # before the load: the heap would keep the tokenizer build's peak as well.
        keep_buffers_in_heap()
    text_cfg = hf_config.get("text_config") or hf_config
    _use_cpu_kernels(loaded.model, config, device)
    source = resolve_model(model_dir)
    if source.is_gguf:
        memory = weight_memory(loaded.model, source.path)
        if memory is not None:
            logger.info("%s", describe(memory, source.path))
    max_pos = int(text_cfg.get("max_position_embeddings") or 8192)
    max_model_len = config.max_model_len or min(max_pos, 8192)
    if max_model_len > max_pos and not config.allow_long_max_model_len:
        raise ValueError(f"max_model_len {max_model_len} is above the model's "
                         f"max_position_embeddings ({max_pos}); lower it, or set "
                         f"allow_long_max_model_len=True to run positions the model was "
                         f"not trained on")
    layout = kv_layout_from_config(hf_config, block_size=config.block_size,
                                   kv_dtype=dtype_name)
    draft = _draft(config, device, dtype_name, int(text_cfg["vocab_size"]), loaded.tokenizer,
                   (model_dir, loaded, hf_config, layout))
    if draft is not None:  # its layers are planned with the target's (engine/draft.py)
        layout = replace(layout, layer_specs={**layout.layer_specs, **draft.layer_specs},
                         kv_sharing={**layout.kv_sharing, **draft.kv_sharing})
    refused = getattr(loaded.model, "refused_cache_dtypes", {}).get(config.kv_cache_dtype)
    if refused is not None:
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype!r}: {refused}")
    layout = replace(layout, layer_specs=apply_cache_dtype(
        layout.layer_specs, config.kv_cache_dtype, config.kv_cache_dtype_skip,
        config.state_dtype))
    if config.speculative is not None:
        layout = replace(layout, layer_specs=with_speculative_states(layout.layer_specs,
                                                                   config.max_num_seqs))
    if config.kv_cache_dtype == "fp8" and not device.startswith("cuda"):
        # e4m3 has no fast conversion on CPUs: int8 pages hold as many bytes and are read
        # by the in-place kernel.
        raise ValueError(f"kv_cache_dtype 'fp8' runs on CUDA devices, not {device}; use "
                         f"int8 (the same bytes per token) or q4 here")
    kv_cache_memory = int(config.kv_cache_memory) if config.kv_cache_memory is not None \
        else default_kv_cache_memory(layout, config, max_model_len, device)
    if config.kv_cache_memory is None and config.max_model_len is None:
        fitting = _fitting_len(layout, kv_cache_memory, max_model_len, config)
        if 0 < fitting < max_model_len:
            logger.warning("max_model_len lowered from %d to %d: what one request can hold "
                           "in the KV cache's %s (set kv_cache_memory or max_model_len to "
                           "choose)", max_model_len, fitting, format_bytes(kv_cache_memory))
            max_model_len = fitting
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                         f"({config.max_num_batched_tokens}) must be >= max_model_len "
                         f"({max_model_len})")
    if draft is not None:
        draft.check_max_model_len(max_model_len)
        logger.info("%s", draft.describe(layout.layer_specs))
    plan = plan_kv_cache(layout.layer_specs, kv_cache_memory,
                         max_model_len=max_model_len,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         hybrid=not config.disable_hybrid_kv_cache,
                         kv_sharing=layout.kv_sharing,
                         enable_caching=config.enable_prefix_caching,
                         checkpoint_interval=config.mamba_checkpoint_interval,
                         checkpoint_tail=config.mamba_checkpoint_tail)
    if config.kv_sharing_fast_prefill and getattr(loaded.model, "kv_shared_from",
                                                  None) is None:
        raise ValueError(
            f"kv_sharing_fast_prefill needs a model whose last layers only read other "
            f"layers' KV (num_kv_shared_layers or kv_sharing_target_layers in config.json"
            f"); {layout.model_type} at {model_dir} has none")
    cache_options = config.cache_options()
    # Without a shared seed a later process (a replica) would hash every block differently.
    cache_options["hash_seed"], remote_seed = block_hash_seed(config)
    kv_manager = KVCacheManager(plan.config, max_model_len=max_model_len, **cache_options)
    connector = None
    if config.kv_offload:
        fingerprint = layout_fingerprint(model_identity(str(resolve_model(model_dir).path)),
                                         plan.config,
                                         kv_manager.hash_fingerprint)
        chain = build_tier_chain(config, plan.config, fingerprint, remote_seed=remote_seed)
        connector = OffloadConnectorScheduler(
            kv_manager, chain, fingerprint, store_policy=config.kv_offload_store,
            load_timeout_s=float(config.kv_offload_load_timeout_s))
    scheduler = Scheduler(config.scheduler_config(max_model_len), kv_manager, connector)
    runner = ModelRunner(loaded.model, plan.config,
                         config.runner_config(max_model_len, device))
    if draft is not None:
        runner.draft = draft.make_drafter(draft.model, runner.kv_caches, runner.layer_group)
    if connector is not None:
        runner.connector = OffloadConnectorWorker(
            canonical_kv_caches(plan.config, runner.arena), connector.chain,
            connector.completions)
    vocab = int(text_cfg["vocab_size"])
    return EngineParts(scheduler=scheduler, runner=runner, plan=plan,
                       max_model_len=max_model_len,
                       vocab_size=int(getattr(loaded.model, "logits_size", vocab)),
                       input_vocab_size=vocab,
                       tokenizer=loaded.tokenizer, eos_token_ids=loaded.eos_token_ids,
                       chat_template=loaded.chat_template,
                       special_tokens=loaded.special_tokens)
