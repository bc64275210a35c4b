"""What the model runner is told at start: sizes of the persistent batch, where to run, which
attention backend, and the optional KV-sharing fast prefill. Derived from the user's
`EngineConfig` once the model's limits are known (`EngineConfig.runner_config`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    max_num_seqs: int  # rows of the persistent batch and of every block table
    max_model_len: int
    device: str = "cpu"  # a torch device string, already resolved ("auto" is not accepted)
    attention_backend: str = "auto"
    kernel_block_size: int | None = None  # must divide every attention group's block size
    # Run layers that only read other layers' KV on the sampled tokens only.
    kv_sharing_fast_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.device == "auto":
            raise ValueError("RunnerConfig.device must be resolved (cpu, cuda, cuda:N)")
