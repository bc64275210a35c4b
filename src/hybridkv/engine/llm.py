"""Offline generation: `LLM(model_dir, **options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any

from hybridkv.config import EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.engine.outputs import RequestOutput
from hybridkv.sched.sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """`with LLM(model_dir, **options) as llm:` closes the engine on leaving the block (its
    queued KV writes reach the tiers); an LLM that is dropped (`del llm`) or still open at
    exit is closed the same way."""

    def __init__(self, model_dir: str, **engine_options: Any) -> None:
        if not isinstance(model_dir, (str, os.PathLike)):
            raise ValueError(f"model_dir must be a path, got {type(model_dir).__name__}")
        model_dir = os.fspath(model_dir)
        self.engine = LLMEngine.from_model_dir(model_dir, EngineConfig.from_kwargs(engine_options))
        self._counter = 0
        # Holds the engine, not the LLM: runs when the LLM is collected, or at exit (before
        # the interpreter tears modules down), whichever comes first; once.
        self._finalizer = weakref.finalize(self, LLMEngine.close, self.engine)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs in prompt
        order, and a prompt whose params ask for n > 1 samples gets n outputs in a row
        (`index` 0..n-1). Every argument is checked before any request is queued: a rejected call
        leaves nothing behind. A request that fails while running comes back with
        finish_reason "error" and its `error`; the others are unaffected."""
        prompt_list = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompt_list))
        if priority is not None and (isinstance(priority, (str, bytes))
                                     or not isinstance(priority, Sequence)):
            raise ValueError(f"priority must be a list of ints (one per prompt), got "
                             f"{type(priority).__name__}")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"{len(priorities)} priorities for {len(prompt_list)} prompts")
        if use_tqdm is not None and not isinstance(use_tqdm, bool):
            raise ValueError(f"use_tqdm must be True, False or None, got {use_tqdm!r}")
        ids: list[tuple[str, int]] = []  # (request id, n)
        for index, (prompt, p, prio) in enumerate(zip(prompt_list, params, priorities,
                                                      strict=True)):
            rid = str(self._counter)
            self._counter += 1
            try:
                self.engine.add_request(rid, prompt, p, priority=prio)
            except ValueError as e:
                for queued, _ in ids:
                    self.engine.abort_request(queued)
                message = str(e).removeprefix(f"request {rid}: ")
                raise ValueError(f"prompt {index}: {message}") from None
            ids.append((rid, self.engine.num_samples(rid)))
        results: dict[tuple[str, int], RequestOutput] = {}
        total = sum(n for _, n in ids)
        show = use_tqdm if use_tqdm is not None else (total >= 8 and sys.stderr.isatty())
        progress = _progress(total) if show else None
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id, out.index] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [results[rid, i] for rid, n in ids for i in range(n)]


    def reset_prefix_cache(self) -> bool:
        """Drop the device prefix cache only; offload tiers keep theirs. False while
        requests are running."""
        return self.engine.reset_prefix_cache()

    def offload_stats(self) -> dict[str, Any] | None:
        return self.engine.offload_stats()

    def close(self) -> None:
        """Write the device prefix cache and the queued KV writes to the tiers and stop the
        offload thread (nothing to do without offloading). Generating afterwards still
        works, without the tiers."""
        self._finalizer()


def _progress(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generate", unit="req")


def _prompt_list(prompts: object) -> list[object]:
    """One prompt or a list of them -> a list of prompts (each checked by the engine)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    hint = " (convert it with .tolist())" if hasattr(prompts, "tolist") else ""
    raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                     f"got {type(prompts).__name__}{hint}")


def _params_list(sampling_params: object, n: int) -> list[Any]:
    if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
        return [sampling_params] * n
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts")
        return list(sampling_params)
    raise ValueError(f"sampling_params must be a SamplingParams, a dict of its fields, or a "
                     f"list of those (one per prompt); got {type(sampling_params).__name__}")
