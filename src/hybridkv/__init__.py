"""hybridkv: a small LLM inference engine built around a hybrid KV cache manager."""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Lazy, so that `import hybridkv.kv` never pulls in torch.
    if name in ("LLM", "SamplingParams"):
        from hybridkv.engine.llm import LLM
        from hybridkv.sched.sampling import SamplingParams

        return {"LLM": LLM, "SamplingParams": SamplingParams}[name]
    raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")
