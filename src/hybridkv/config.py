"""Engine options, with the names users of inference engines expect.

Users set one flat `EngineConfig`; each part of the engine gets its own frozen config derived
from it (`scheduler_config`, `runner_config`, `cache_options`), so a part never reads options
that are not its own and a new option is added in one place plus the part that uses it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from hybridkv.connector.events import check_endpoint
from hybridkv.connector.offload.redis_tier import parse_remote_url
from hybridkv.connector.offload.store import parse_tier_spec
from hybridkv.connector.scheduler import STORE_POLICIES
from hybridkv.kv.cache_dtype import check_kv_cache_dtype, check_state_dtype, parse_skip
from hybridkv.kv.plan import parse_bytes
from hybridkv.kv.spec import DEFAULT_CHECKPOINT_TAIL
from hybridkv.sched.checks import check_bool, check_int
from hybridkv.sched.scheduler import SchedulerConfig
from hybridkv.sched.spec import SpeculativeConfig
from hybridkv.worker.config import RunnerConfig

# The KV cache / weights dtypes the engine runs ("auto": the checkpoint's own).
DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _choice(name: str, value: object, accepted: Sequence[object]) -> None:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(map(str, accepted))}, got "
                         f"{value!r}")


def _memory(value: object, name: str = "kv_cache_memory") -> int:
    """A byte budget: bytes (an int, or a whole float such as 1.5e8) or a size string."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be bytes (an integer) or a size such as "
                         f"'8GiB', got {value!r} ({type(value).__name__})")
    try:
        nbytes = parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if nbytes <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return nbytes


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_model_len: int | None = None  # default: the model's, capped at 8192
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kernel_block_size: int | None = None  # must divide block_size
    # KV cache bytes; None: what max_num_seqs requests of max_model_len need, at most half
    # the memory available once the model is loaded (engine/build.py:
    # default_kv_cache_memory).
    kv_cache_memory: int | str | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    disable_hybrid_kv_cache: bool = False
    dtype: str = "auto"  # the checkpoint's dtype ("auto"), or bf16 / fp16 / fp32
    device: str = "auto"  # cuda when available, else cpu
    attention_backend: str = "auto"
    scheduling_policy: str = "fcfs"  # or "priority": lower `priority` values first
    mamba_checkpoint_interval: int = 0  # also save state checkpoints every N blocks
    mamba_checkpoint_branch_points: bool = True  # and where requests leave a cached prefix
    # and at each of the last N block boundaries of a prompt and of an output (where a
    # chat's next turn parts from this one: an edited message, a resent answer)
    mamba_checkpoint_tail: int = DEFAULT_CHECKPOINT_TAIL
    # "value": weigh cached blocks by prefix tokens per byte; "lru". Default: value for
    # models with state layers, lru otherwise.
    kv_eviction: str | None = None
    # Run layers that only read other layers' KV (Gemma 3n/4, YOCO) on the sampled tokens
    # only: during prefill their other tokens' outputs are never used.
    kv_sharing_fast_prefill: bool = False
    # torch intra-op threads (process-wide). None: the cores in this process's CPU affinity
    # mask (capped by OMP_NUM_THREADS when set), not the machine's count.
    threads: int | None = None
    # Linear layers: "cpu" (hybridkv's C kernel on weights packed once; CPU, float32),
    # "onednn" (weights prepacked once for oneDNN's GEMM; CPU, float32 or bfloat16), "torch"
    # (F.linear), "auto": "cpu" where it runs, else oneDNN, else torch (CUDA).
    linear_kernel: str = "auto"
    # GGUF models: weights are kept in their quantized blocks on the CPU; True dequantizes
    # them to `dtype` at load (4-8x the memory; what CUDA devices do anyway).
    dequantize: bool = False
    # GGUF models on CPUs: "float32" keeps the activations in float (exact against the
    # dequantized model); "int8" quantizes a decode step's few rows to 8 bits for integer dot
    # products (llama.cpp's choice: ~2x faster matrices at batch 1, logits off by up to a few
    # units). Process-wide, like `threads`.
    quant_activations: str = "float32"
    # How KV pages are stored: "auto" (the model's dtype) or quantized for every attention
    # group: "int8" (a quarter of float32's bytes), "q4" (4-bit after a Hadamard rotation),
    # "fp8" (e4m3; CUDA). Kinds named in kv_cache_dtype_skip ("sliding", "full", "chunked",
    # "cross"; a comma list) keep the model's dtype. state_dtype: recurrent states' dtype
    # ("auto": as the model declares them; "float32", "bf16", "fp16").
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip: str | tuple[str, ...] | None = None
    state_dtype: str = "auto"

    # Serve a max_model_len above the model's max_position_embeddings (positions the model
    # was never trained on); refused unless set, as vLLM does.
    allow_long_max_model_len: bool = False
    # Block hashes are keyed by a secret: by default a random one per process, so nobody
    # can craft a prompt whose block collides with another user's cached prefix. Set one
    # secret seed where processes must agree on hashes (a shared tier); "sha256" resists
    # collision search by design, at ~1.5x the hashing cost of xxh3.
    block_hash_seed: str | None = None
    block_hash_algo: str = "xxh3"

    # KV offloading: blocks leaving the device go to CPU memory (a byte budget, e.g. "8GiB")
    # and/or a local disk directory ("DIR:50GiB"), and prefixes found there are loaded back
    # instead of recomputed. With a disk tier and no block_hash_seed, the seed is kept in the
    # directory so that a later process can reuse its blocks.
    kv_offload_cpu: int | str | None = None
    kv_offload_disk: str | None = None
    kv_offload_store: str = "evict"  # copy blocks out when evicted, or "fill": when filled
    kv_offload_load_timeout_s: float = 30.0  # a slower load is given up: recomputed
    # A remote tier shared by replicas, after the local ones: redis://HOST:PORT/DB (rediss://
    # for TLS; a password in the URL or $HYBRIDKV_KV_REMOTE_PASSWORD). Without
    # block_hash_seed, the processes on one Redis share the seed stored there.
    kv_remote: str | None = None
    kv_remote_ttl_s: int | None = None  # keys expire this long after their last store / hit
    kv_remote_timeout_s: float = 1.0  # on every connect and reply; past it Redis is "down"
    kv_remote_queue: int | str = "256MiB"  # stores waiting to be sent; beyond it, dropped

    # KV events for routers and indexers, in vLLM's ZMQ wire format (connector/events.py):
    # a PUB socket at this endpoint (tcp://*:PORT binds, tcp://HOST:PORT binds where it can
    # and connects to a subscriber that bound it otherwise), the topic, an optional replay
    # (ROUTER) endpoint, and how many steps' batches may wait for the publisher thread
    # (topic and queue None: "kv-events" and 10,000; set without an endpoint, refused).
    kv_events_endpoint: str | None = None
    kv_events_topic: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_queue: int | None = None
    # This replica's index among `hybridkv serve --data-parallel-size N` replicas: its KV
    # event endpoints' ports are offset by it (vLLM's layout). Its events still say
    # data-parallel rank 0: each replica is its own server, the one engine behind its URL,
    # and routers file a batch's blocks under the rank it names for the URL it came from.
    replica_index: int = 0

    # Speculative decoding, with vLLM's names: {"method": "ngram", "num_speculative_tokens":
    # K, "prompt_lookup_max": N, "prompt_lookup_min": M} or {"method": "draft_model",
    # "model": PATH, "num_speculative_tokens": K} (a dict, read into a SpeculativeConfig);
    # None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Every option is checked here, with one line naming it and what is accepted: a wrong
        # type found later would surface as an internal error far from its cause.
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            check_int(name, getattr(self, name), low=1)
        for name in ("max_model_len", "kernel_block_size", "threads"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1, what="an integer >= 1 or None")
        check_int("mamba_checkpoint_interval", self.mamba_checkpoint_interval, low=0,
                  what="an integer >= 0 (0 = no interval checkpoints)")
        check_int("mamba_checkpoint_tail", self.mamba_checkpoint_tail, low=1,
                  what="an integer >= 1 (block boundaries at a prompt's and an output's end)")
        for f in fields(self):
            if f.type == "bool":
                check_bool(f.name, getattr(self, f.name))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} cannot run here; accepted: "
                             f"{', '.join(DTYPES)}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be one of auto, cpu, cuda, cuda:N, got "
                             f"{self.device!r}")
        _choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        _choice("kv_eviction", self.kv_eviction, (None, "lru", "value"))
        _choice("block_hash_algo", self.block_hash_algo, ("xxh3", "sha256"))
        _choice("linear_kernel", self.linear_kernel, ("auto", "cpu", "onednn", "torch"))
        _choice("quant_activations", self.quant_activations, ("float32", "int8"))
        check_kv_cache_dtype(self.kv_cache_dtype)
        parse_skip(self.kv_cache_dtype_skip)
        check_state_dtype(self.state_dtype)
        if self.block_hash_seed is not None and (not isinstance(self.block_hash_seed, str)
                                                 or not self.block_hash_seed):
            raise ValueError("block_hash_seed must be a non-empty string or None (a random "
                             "seed per process)")
        if not isinstance(self.attention_backend, str):
            raise ValueError(f"attention_backend must be a name such as 'torch', got "
                             f"{self.attention_backend!r}")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", _memory(self.kv_cache_memory))
        if self.kv_offload_cpu is not None:
            object.__setattr__(self, "kv_offload_cpu",
                               _memory(self.kv_offload_cpu, "kv_offload_cpu"))
        if self.kv_offload_disk is not None:
            if not isinstance(self.kv_offload_disk, str):
                raise ValueError(f"kv_offload_disk must be a string DIR:SIZE such as "
                                 f"'/mnt/kv:50GiB', got {self.kv_offload_disk!r}")
            parse_tier_spec(self.kv_offload_disk, flag="kv_offload_disk")
        _choice("kv_offload_store", self.kv_offload_store, STORE_POLICIES)
        if self.kv_remote is not None:
            parse_remote_url(self.kv_remote, flag="kv_remote")
        if self.kv_remote_ttl_s is not None:
            check_int("kv_remote_ttl_s", self.kv_remote_ttl_s, low=1,
                      what="a whole number of seconds >= 1, or None (no expiry)")
        remote_timeout = self.kv_remote_timeout_s
        if isinstance(remote_timeout, bool) or not isinstance(remote_timeout, (int, float)) \
                or not math.isfinite(remote_timeout) or remote_timeout <= 0:
            raise ValueError(f"kv_remote_timeout_s must be a number of seconds > 0, got "
                             f"{remote_timeout!r}")
        object.__setattr__(self, "kv_remote_queue",
                           _memory(self.kv_remote_queue, "kv_remote_queue"))
        timeout = self.kv_offload_load_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"kv_offload_load_timeout_s must be a number of seconds > 0, "
                             f"got {timeout!r}")
        if self.kv_events_queue is not None:
            check_int("kv_events_queue", self.kv_events_queue, low=1,
                      what="an integer >= 1 or None (10,000)")
        check_int("replica_index", self.replica_index, low=0)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        if self.kv_events_topic is not None and not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic must be a string, got {self.kv_events_topic!r}")
        if self.kv_events_endpoint is None:
            # Options of a publisher that will not exist would silently do nothing.
            for name in ("kv_events_queue", "kv_events_topic", "kv_events_replay_endpoint"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} (--{name.replace('_', '-')}) applies to "
                                     f"published KV events; set kv_events_endpoint "
                                     f"(--kv-events-endpoint) too, or leave it out")
        if self.kv_events_endpoint is not None:
            check_endpoint(self.kv_events_endpoint)
            if not self.enable_prefix_caching:
                raise ValueError("kv_events_endpoint needs enable_prefix_caching (events "
                                 "announce the blocks the prefix cache can serve)")
        if self.kv_events_replay_endpoint is not None:
            check_endpoint(self.kv_events_replay_endpoint, "kv_events_replay_endpoint")
        if self.kv_offload and not self.enable_prefix_caching:
            raise ValueError("kv_offload_cpu / kv_offload_disk / kv_remote need "
                             "enable_prefix_caching "
                             "(tiers serve blocks by their content hash)")

    @property
    def kv_offload(self) -> bool:
        return (self.kv_offload_cpu is not None or self.kv_offload_disk is not None
                or self.kv_remote is not None)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        """From user options: unknown names are an error naming the accepted ones."""
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
                               policy=self.scheduling_policy,
                               speculative=self.speculative)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        spec = self.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # read in __post_init__
        return spec

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
                "checkpoint_tail": self.mamba_checkpoint_tail,
                "eviction": self.kv_eviction, "hash_seed": self.block_hash_seed,
                "hash_algo": self.block_hash_algo}
