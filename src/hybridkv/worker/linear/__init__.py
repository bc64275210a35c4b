"""Linear layers as the runner runs them: fused projections and the choice of kernel
(layers.py), float32 weights packed for hybridkv's own C kernel (cpu.py), GGML-quantized
weights kept in their GGUF blocks and multiplied by the C kernels of ../native (quant.py),
and the modules that stand where a model's `nn.Linear` / `nn.Embedding` stood over such
weights (quantized.py)."""
