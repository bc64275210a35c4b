"""The engine loop: requests in, scheduler + model runner each step, outputs out.

    engine.add_request(rid, prompt, params)     # bad input raises here; others keep going
    while engine.has_unfinished:
        for out in engine.step(): ...            # streaming: new tokens/text per request
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hybridkv.config import EngineConfig
from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.outputs import RequestOutput
from hybridkv.kv.manager import KVCacheManager
from hybridkv.kv.plan import plan_kv_cache
from hybridkv.models.layer_mix import kv_layout_from_config
from hybridkv.models.loader import load_model, read_config
from hybridkv.sched.request import Request, RequestStatus
from hybridkv.sched.sampling import SamplingParams
from hybridkv.sched.scheduler import Scheduler, SchedulerConfig
from hybridkv.worker.kv_cache import torch_dtype
from hybridkv.worker.model_runner import ModelRunner


class LLMEngine:
    def __init__(self, model_dir: str, config: EngineConfig) -> None:
        self.config = config
        device = torch.device(config.device if config.device != "auto" else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        hf_config = read_config(Path(model_dir))
        text_cfg = hf_config.get("text_config") or hf_config
        dtype_name = config.dtype if config.dtype != "auto" else str(
            text_cfg.get("torch_dtype") or hf_config.get("torch_dtype")
            or hf_config.get("dtype") or "float32")
        dtype = torch_dtype(dtype_name)
        loaded = load_model(model_dir, dtype=dtype, device=device, config=hf_config)
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = int(text_cfg["vocab_size"])
        max_pos = text_cfg.get("max_position_embeddings") or 8192
        self.max_model_len = config.max_model_len or min(int(max_pos), 8192)
        layout = kv_layout_from_config(hf_config, block_size=config.block_size,
                                       kv_dtype=dtype_name)
        plan = plan_kv_cache(layout.layer_specs, int(config.kv_cache_memory),
                             max_model_len=self.max_model_len,
                             max_num_batched_tokens=config.max_num_batched_tokens,
                             hybrid=not config.disable_hybrid_kv_cache,
                             kv_sharing=layout.kv_sharing)
        self.plan = plan
        self.kv_manager = KVCacheManager(plan.config, max_model_len=self.max_model_len,
                                         enable_caching=config.enable_prefix_caching,
                                         checkpoint_interval=config.mamba_checkpoint_interval,
                                         checkpoint_branch_points=(
                                             config.mamba_checkpoint_branch_points),
                                         eviction=config.kv_eviction)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=self.max_model_len,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            policy=config.scheduling_policy),
            self.kv_manager)
        if not config.enable_chunked_prefill and \
                config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens "
                             f"({config.max_num_batched_tokens}) must be >= max_model_len "
                             f"({self.max_model_len})")
        if config.kv_sharing_fast_prefill and getattr(loaded.model, "kv_shared_from",
                                                      None) is None:
            raise ValueError(
                f"kv_sharing_fast_prefill needs a model whose last layers only read other "
                f"layers' KV (num_kv_shared_layers or kv_sharing_target_layers in config.json"
                f"); {layout.model_type} at {model_dir} has none")
        self.runner = ModelRunner(
            loaded.model, plan.config, max_num_reqs=config.max_num_seqs,
            max_model_len=self.max_model_len, device=device,
            attention_backend=config.attention_backend,
            kernel_block_size=config.kernel_block_size, keep_logits=config.keep_logits,
            kv_sharing_fast_prefill=config.kv_sharing_fast_prefill)
        self._params: dict[str, SamplingParams] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._logits: dict[str, list[torch.Tensor]] = {}
        self._next_index = 0

    # ---------------------------------------------------------------- requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass token ids")
            return list(self.tokenizer.encode(prompt).ids)
        return [int(t) for t in prompt]

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    params: SamplingParams | dict[str, Any] | None = None, *,
                    priority: int = 0) -> None:
        """Validate and queue a request; a bad one raises ValueError and changes nothing."""
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        params = params or SamplingParams()
        if request_id in self._params:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.encode(prompt)
        if not token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id}: the prompt has {len(token_ids)} tokens, "
                             f"max_model_len is {self.max_model_len} (prompt + at least one "
                             f"generated token must fit)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token id {bad[0]} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        request = Request(request_id, token_ids, params,
                          hash_block_size=self.plan.config.hash_block_size,
                          eos_token_ids=self.eos_token_ids, arrival_index=self._next_index,
                          priority=priority)
        self._next_index += 1
        self._params[request_id] = params
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.scheduler.finish([request], RequestStatus.FINISHED_ABORTED)
            self._forget(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.num_scheduled_tokens:
            if self.scheduler.waiting and not self.scheduler.running:
                request = self.scheduler.waiting[0]
                self.scheduler.finish([request], RequestStatus.FINISHED_ABORTED)
                self._forget(request.request_id)
                raise RuntimeError(f"request {request.request_id} does not fit in the KV "
                                   f"cache even alone; raise kv_cache_memory")
            return []
        result = self.runner.execute(out, self._params)
        updated = self.scheduler.update_from_output(out, result.sampled)
        outputs = []
        finished: dict[RequestStatus, list[Request]] = {}
        for request in updated:
            rid = request.request_id
            if rid in result.logprobs:
                request.output_logprobs.append(result.logprobs[rid])
            if rid in result.logits:
                self._logits.setdefault(rid, []).append(result.logits[rid])
            status = self._check_stop(request)
            new_text, stopped = self._detokenize(request, final=status is not None)
            if stopped and status is None:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                finished.setdefault(status, []).append(request)
            outputs.append(self._output(request, status, new_text))
        for status, requests in finished.items():
            self.scheduler.finish(requests, status)
            for request in requests:
                self._forget(request.request_id)
        return outputs

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.token_ids[-1]
        if not params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or \
                request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _detokenize(self, request: Request, *, final: bool) -> tuple[str, bool]:
        """(new text, whether a stop string ended the request there)."""
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            return "", False
        new_text, stop = detokenizer.add(request.output_token_ids, final=final)
        if stop is not None:
            request.stop_reason = stop
        return new_text, stop is not None

    def _output(self, request: Request, status: RequestStatus | None,
                new_text: str) -> RequestOutput:
        rid = request.request_id
        detokenizer = self._detokenizers.get(rid)
        return RequestOutput(
            request_id=rid, prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=detokenizer.text if detokenizer else "",
            finished=status is not None, finish_reason=status.value if status else None,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs
            is not None else None,
            new_token_ids=[request.token_ids[-1]], new_text=new_text,
            logits=self._logits.get(rid))

    def _forget(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._detokenizers.pop(request_id, None)
        self._logits.pop(request_id, None)
