"""KV connectors: moving blocks of every KV cache group between device memory and other
tiers. So far: the canonical KV caches a connector copies blocks through."""
