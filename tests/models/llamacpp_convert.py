"""Tiny random models written to GGUF by llama.cpp's own converter (`convert_hf_to_gguf.py`),
where its source is on this machine (`HYBRIDKV_LLAMACPP_SRC`, default
~/.cache/hybridkv-peers/llama.cpp/src, as ../shared/bench/peer-llamacpp/setup.sh unpacks it).

The converter runs in a process of its own with its own `gguf-py` (it may be newer than the
installed `gguf` package). Its vocabulary routines are each family's (SentencePiece for Llama,
Gemma's special tokens, ...), but a tiny model's tokenizer is a 256-token byte-level BPE that
none of them knows: every model class writes it as the gpt2 routine does, under the `gpt-2`
pre-tokenizer. Weights, metadata and tensor names are the converter's own.

Types: f32 and q8_0 as the converter writes them; q4_0 as `llama-quantize` makes it from the
f32 file (every matrix the converter would quantize, to Q4_0, rows that no block fits left as
they are), done here with the `gguf` package's quantizer where no llama-quantize is built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from tests.models import gguf_writer

SOURCE = Path(os.environ.get("HYBRIDKV_LLAMACPP_SRC",
                             Path.home() / ".cache/hybridkv-peers/llama.cpp/src"))
CONVERTER = SOURCE / "convert_hf_to_gguf.py"

# Run inside the converter's process: its gguf-py first, every vocabulary routine as gpt2's.
_WRAPPER = """
import sys
sys.path[:0] = [{gguf_py!r}, {source!r}]
import convert_hf_to_gguf as c
from conversion import base

family_class = c.get_model_class

def gpt2_vocabulary(*args, **kwargs):
    cls = family_class(*args, **kwargs)
    cls.set_vocab = base.TextModel._set_vocab_gpt2
    return cls

if not {family_vocab!r}:
    c.get_model_class = gpt2_vocabulary
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *{argv!r}]
c.main()
"""


def available() -> bool:
    return CONVERTER.is_file()


def write_byte_tokenizer(model_dir: Path) -> None:
    """A 256-token byte-level BPE as tokenizer.json, the tiny models' vocabulary size: 254
    byte characters of GPT-2's map, one merge ("!!"; the converter leaves an empty merge
    list out of the file, and a BPE vocabulary wants one) and `<|endoftext|>` (which some
    families' tokenizer classes add when it is missing, past the vocabulary)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:254] + ["!!"]
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)},
                                     merges=[("!", "!")]))
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast"}))


def convert(model_dir: Path, out: Path, outtype: str, *extra: str,
            family_vocab: bool = False) -> Path:
    """`model_dir` (with a tokenizer, see write_byte_tokenizer) as a GGUF file of `outtype`
    (f32, q8_0, ... as the converter takes them). `family_vocab`: the family's own vocabulary
    routine writes the tokenizer (for a tokenizer in that family's format)."""
    code = _WRAPPER.format(gguf_py=str(SOURCE / "gguf-py"), source=str(SOURCE),
                           family_vocab=family_vocab, argv=[
        str(model_dir), "--outfile", str(out), "--outtype", outtype, *extra])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "NO_LOCAL_GGUF": "1"}, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{done.stderr[-4000:]}")
    return out


def _quantizable(name: str, shape: tuple[int, ...], block: int) -> bool:
    """What llama-quantize quantizes: matrices (not norms, not the 1-D or F32-kept tensors
    the converter marks), rows a whole number of blocks."""
    kept = ("norm", "ssm_conv1d", "shortconv.conv", "ffn_gate_inp", "ssm_a", "ssm_d",
            "ssm_dt", "altup_router", "per_layer_model_proj")
    return len(shape) >= 2 and name.endswith(".weight") and not any(k in name for k in kept) \
        and shape[-1] % block == 0


def requantize(source: Path, out: Path, qtype: T) -> Path:
    """`source` (float tensors) with its matrices as `qtype`, metadata copied as it is."""
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        gguf_writer.copy_field(writer, name, field)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists them innermost first
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if tensor.tensor_type in (T.F32, T.F16) and _quantizable(tensor.name, shape, block):
            data = gguf.quants.quantize(values.reshape(-1, shape[-1]).astype(np.float32), qtype)
            writer.add_tensor(tensor.name, data.reshape(*shape[:-1], -1), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_mtp_layer(model_dir: Path, *, source_layer: int, seed: int = 0) -> None:
    """A multi-token-prediction block as released Qwen3.5 / Qwen3-Next checkpoints carry it
    (`mtp.*`, `mtp_num_hidden_layers` = 1): `fc` [hidden, 2 * hidden] over the normed embedding
    and hidden state, a decoder layer shaped as layer `source_layer` (a full-attention one),
    a final norm. transformers' text models do not run it; the converter writes it as the
    `nextn` layer after the others."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((model_dir / "config.json").read_text())
    hidden = int(config["hidden_size"])
    rng = np.random.default_rng(seed)
    prefix = f"model.layers.{source_layer}."
    for name, value in list(tensors.items()):
        if name.startswith(prefix):
            noise = rng.standard_normal(value.shape).astype(value.dtype) * 0.02
            tensors["mtp.layers.0." + name.removeprefix(prefix)] = value + noise
    tensors["mtp.fc.weight"] = (rng.standard_normal((hidden, 2 * hidden)) * 0.1).astype(
        np.float32)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config["mtp_num_hidden_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


# Text for the Gemma-style tokenizer's merges and for the tests that encode with it.
GEMMA_TEXT = ("the cat sat on the mat\n\nthe dog  sat   on a log\n"
              "a cat and a dog, then the end. Été: 42 + 7 = 49!\n\n\n  tab\there")


def write_gemma_tokenizer(model_dir: Path) -> int:
    """A tiny tokenizer.json shaped as Gemma's (transformers' GemmaTokenizer): <pad> <eos>
    <bos> <unk> <mask>, the 256 byte-fallback tokens <0x00>..<0xFF>, then BPE pieces learnt
    from GEMMA_TEXT with spaces as U+2581; spaces replaced by a normalizer, the merges run
    over the whole text. Returns the vocabulary size (the model's must equal it)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.train_from_iterator([GEMMA_TEXT] * 4, trainers.BpeTrainer(
        vocab_size=120, special_tokens=specials, show_progress=False))
    learnt = json.loads(learner.to_str())["model"]
    pieces = [p for p, _ in sorted(learnt["vocab"].items(), key=lambda kv: kv[1])
              if p not in specials]
    vocab = {t: i for i, t in enumerate(
        [*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in learnt["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                     byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                           decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
         "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}))
    return len(vocab)
