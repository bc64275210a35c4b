"""Attention over the paged KV cache: the per-group metadata and the backend registry
(backend.py: the torch reference backend), the "cpu" backend that reads the pages in place
through the C kernels of ../native (cpu.py), query-dependent scores (scored.py), multi-head
latent attention and its sparse variants (mla.py, sparse_mla.py, qsa.py), and the quantized
KV rows the pages of a `kv_cache_dtype` group hold (kv_quant.py)."""
