"""The engine loop, the offline `LLM` API, detokenizer and outputs."""
