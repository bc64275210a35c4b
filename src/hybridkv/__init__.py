"""hybridkv: a small LLM inference engine built around a hybrid KV cache manager."""

__version__ = "0.1.0"
