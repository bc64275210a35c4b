"""Engine options, with the names users of inference engines expect.

Users set one flat `EngineConfig`; each part of the engine gets its own frozen config derived
from it (`scheduler_config`, `runner_config`, `cache_options`), so a part never reads options
that are not its own and a new option is added in one place plus the part that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hybridkv.kv.plan import parse_bytes
from hybridkv.sched.scheduler import SchedulerConfig
from hybridkv.worker.config import RunnerConfig


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_model_len: int | None = None  # default: the model's, capped at 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kernel_block_size: int | None = None  # must divide block_size
    kv_cache_memory: int | str = "256MiB"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    disable_hybrid_kv_cache: bool = False
    dtype: str = "auto"  # the checkpoint's dtype ("auto"), or bf16 / fp16 / fp32
    device: str = "auto"  # cuda when available, else cpu
    attention_backend: str = "torch"
    scheduling_policy: str = "fcfs"  # or "priority": lower `priority` values first
    mamba_checkpoint_interval: int = 0  # also save state checkpoints every N blocks
    mamba_checkpoint_branch_points: bool = True  # and where requests leave a cached prefix
    # "value": weigh cached blocks by prefix tokens per byte; "lru". Default: value for
    # models with state layers, lru otherwise.
    kv_eviction: str | None = None
    # Run layers that only read other layers' KV (Gemma 3n/4, YOCO) on the sampled tokens
    # only: during prefill their other tokens' outputs are never used.
    kv_sharing_fast_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; accepted: "
                             f"{', '.join(sorted(known))}")
        return cls(**kwargs)

    # ------------------------------------------------------------ the parts' configs
    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=max_model_len,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               policy=self.scheduling_policy)

    def runner_config(self, max_model_len: int, device: str) -> RunnerConfig:
        return RunnerConfig(max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
                            device=device, attention_backend=self.attention_backend,
                            kernel_block_size=self.kernel_block_size,
                            kv_sharing_fast_prefill=self.kv_sharing_fast_prefill)

    def cache_options(self) -> dict[str, Any]:
        """KVCacheManager's keyword options (besides the plan and max_model_len)."""
        return {"enable_caching": self.enable_prefix_caching,
                "checkpoint_interval": self.mamba_checkpoint_interval,
                "checkpoint_branch_points": self.mamba_checkpoint_branch_points,
                "eviction": self.kv_eviction}
