"""Offline generation: `LLM(model_dir, **options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from hybridkv.config import EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model_dir: str, **engine_options: Any) -> None:
        self.engine = LLMEngine.from_model_dir(model_dir, EngineConfig.from_kwargs(engine_options))
        self._counter = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs in prompt
        order. All prompts are checked before any is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        ids = []
        for prompt, p, prio in zip(prompts, params, priorities, strict=True):
            rid = str(self._counter)
            self._counter += 1
            try:
                self.engine.add_request(rid, prompt, p, priority=prio)
            except ValueError:
                for queued in ids:
                    self.engine.abort_request(queued)
                raise
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else (len(ids) >= 8 and sys.stderr.isatty())
        progress = _progress(len(ids)) if show else None
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [results[rid] for rid in ids]


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generate", unit="req")
