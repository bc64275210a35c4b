"""`hybridkv bench fast-prefill`: KV-sharing fast prefill on vs off, side by side.

Times one prefill forward of the engine (prefix caching off, the whole prompt in one step) on
a Gemma-3n-like demo model: the layers that only read shared KV, and the whole forward, for
one long prompt and for a batch of prompts of mixed lengths. With the flag on, those layers
run on each request's last token only. The sampled tokens must be the same either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridkv.bench.engine import model_vocab
from hybridkv.cli import Command, positive_int


class ForwardTimer:
    """Wall time of the whole forward and of the KV-sharing layers, via module hooks (with a
    device sync on CUDA so that kernels are counted where they run)."""

    def __init__(self, model: Any, first_shared: int) -> None:
        import torch

        self.sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (
            lambda: None)
        self.forward: list[float] = []
        self.shared: list[float] = []
        self._start = self._shared_start = 0.0
        model.register_forward_pre_hook(lambda *_: self._mark("_start"))
        model.register_forward_hook(lambda *_: self._stop())
        model.model.layers[first_shared].register_forward_pre_hook(
            lambda *_: self._mark("_shared_start"))

    def _mark(self, attr: str) -> None:
        self.sync()
        setattr(self, attr, time.perf_counter())

    def _stop(self) -> None:
        self.sync()
        end = time.perf_counter()
        self.forward.append(end - self._start)
        self.shared.append(end - self._shared_start)  # the shared layers run last


def _case(llms: dict[bool, Any], timers: dict[bool, ForwardTimer], prompts: list[list[int]],
          repeat: int) -> dict[str, Any]:
    from hybridkv import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    shared: dict[bool, list[float]] = {False: [], True: []}
    forward: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {}
    for _ in range(repeat):  # interleaved, so both see the same machine load
        for flag in (False, True):
            timer = timers[flag]
            timer.forward.clear()
            timer.shared.clear()
            outs = llms[flag].generate(prompts, params, use_tqdm=False)
            tokens[flag] = [o.token_ids for o in outs]
            if len(timer.forward) != 1:
                raise RuntimeError(f"expected one prefill forward, got {len(timer.forward)}")
            shared[flag].append(timer.shared[0])
            forward[flag].append(timer.forward[0])
    ms = {name: {("on" if flag else "off"): 1000 * statistics.median(values[flag])
                 for flag in (False, True)} for name, values in
          (("shared_layers_ms", shared), ("forward_ms", forward))}
    return {
        "num_prompts": len(prompts), "num_tokens": sum(map(len, prompts)), **ms,
        "shared_layers_ratio": ms["shared_layers_ms"]["on"] / ms["shared_layers_ms"]["off"],
        "forward_ratio": ms["forward_ms"]["on"] / ms["forward_ms"]["off"],
        "same_tokens": tokens[False] == tokens[True],
    }


def bench_fast_prefill(model_dir: str | None = None, *, prompt_len: int = 8192,
                       mixed_lens: tuple[int, ...] = (3072, 2048, 1536, 1024, 384, 128),
                       layers: int = 14, hidden: int = 512, repeat: int = 3,
                       device: str = "auto", as_json: bool = False) -> str:
    import torch

    from hybridkv import LLM
    from hybridkv.models.demo import DemoShape, write_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            shape = DemoShape(layers=layers, hidden=hidden, heads=8, kv_heads=2,
                              head_dim=hidden // 8, intermediate=4 * hidden, vocab=1024,
                              window=512, max_position_embeddings=32768)
            model_dir = str(write_demo_model(Path(tmp) / "gemma3n", "gemma3n", shape))
        vocab = model_vocab(model_dir)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        longest = max(prompt_len, sum(mixed_lens))
        options = dict(dtype="float32", device=device, enable_prefix_caching=False,
                       max_model_len=longest + 16, max_num_batched_tokens=longest,
                       max_num_seqs=max(len(mixed_lens), 1), kv_cache_memory="1GiB")
        llms = {flag: LLM(model_dir, kv_sharing_fast_prefill=flag, **options)
                for flag in (False, True)}
        models = {flag: llm.engine.runner.model for flag, llm in llms.items()}
        first_shared = models[False].kv_shared_from
        timers = {flag: ForwardTimer(models[flag], first_shared) for flag in (False, True)}
        gen = torch.Generator().manual_seed(0)

        def prompt(n: int) -> list[int]:
            return torch.randint(4, vocab, (n,), generator=gen).tolist()

        for llm in llms.values():  # warm up
            llm.generate([prompt(64)], use_tqdm=False)
        num_layers = len(models[False].model.layers)
        result = {
            "model": config.get("model_type") or (config.get("text_config") or {}).get(
                "model_type"),
            "device": str(llms[False].engine.runner.device),
            "num_layers": num_layers, "num_shared_layers": num_layers - first_shared,
            "single": _case(llms, timers, [prompt(prompt_len)], repeat),
            "mixed": _case(llms, timers, [prompt(n) for n in mixed_lens], repeat),
        }
    single = result["single"]
    result["shared_layers_ratio"] = single["shared_layers_ratio"]
    result["forward_ratio"] = single["forward_ratio"]
    if as_json:
        return json.dumps(result)
    lines = [f"{result['model']}: {num_layers} layers, the last {result['num_shared_layers']} "
             f"read shared KV; device {result['device']}; medians of {repeat}, on/off "
             f"interleaved", ""]
    for name in ("single", "mixed"):
        case = result[name]
        s, f = case["shared_layers_ms"], case["forward_ms"]
        lines.append(
            f"{name:<7} {case['num_prompts']} prompt(s), {case['num_tokens']} tokens: "
            f"shared-KV layers {s['on']:.1f} ms on vs {s['off']:.1f} ms off "
            f"({case['shared_layers_ratio']:.3f}x); forward {f['on']:.1f} vs {f['off']:.1f} ms "
            f"({case['forward_ratio']:.3f}x); same tokens: {case['same_tokens']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="a KV-sharing model directory (default: a Gemma-3n-like demo "
                             "model built on the fly)")
    parser.add_argument("--prompt-len", type=positive_int, default=8192,
                        help="tokens of the single long prompt")
    parser.add_argument("--mixed-lens", type=positive_int, nargs="+",
                        default=[3072, 2048, 1536, 1024, 384, 128],
                        help="prompt lengths of the mixed batch")
    parser.add_argument("--layers", type=positive_int, default=14,
                        help="layers of the demo model (3/7 of them read shared KV)")
    parser.add_argument("--hidden", type=positive_int, default=512,
                        help="hidden size of the demo model (8 heads of hidden / 8)")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="runs, flag on and off interleaved; medians reported")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... or auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    print(bench_fast_prefill(args.model_dir, prompt_len=args.prompt_len,
                             mixed_lens=tuple(args.mixed_lens), layers=args.layers,
                             hidden=args.hidden, repeat=args.repeat, device=args.device,
                             as_json=args.json))
    return 0


COMMAND = Command("fast-prefill", "KV-sharing fast prefill on vs off: time of the shared-KV "
                                  "layers and of the forward", add_arguments, run)
