"""A small byte-level BPE tokenizer trained locally with the `tokenizers` library."""

from __future__ import annotations

from pathlib import Path

TEXT = ("the quick brown fox jumps over the lazy dog. hybrid models mix sliding windows "
        "with full attention, and a good engine keeps every byte of the cache busy. ") * 20


def train_tokenizer(out_dir: Path, vocab_size: int = 256) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([TEXT], trainer=trainer)
    path = out_dir / "tokenizer.json"
    tokenizer.save(str(path))
    return path
