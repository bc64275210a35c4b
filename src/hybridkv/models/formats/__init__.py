"""Readers of the formats a model comes in, apart from the families they feed: a Hugging Face
directory (`loader`: config, safetensors, tokenizer) and a GGUF file (`gguf_file`: header and
tensor table; `gguf_config`: metadata -> the Hugging Face config; `gguf_weights`: tensors ->
the family's parameters, kept quantized; `gguf_tokenizer`: the embedded vocabulary). A family
file never knows which of these built it."""
