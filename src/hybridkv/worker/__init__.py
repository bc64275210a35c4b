"""Input batch, block tables per group, KV tensors over the arena, attention, sampling."""
