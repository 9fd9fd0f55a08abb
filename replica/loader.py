"""Load an HF checkpoint folder: config.json, safetensors weights, generation_config.json.

Every failure names the missing or mismatched thing: no config.json, no weights, an index that
names a shard not on disk, tensors the model needs but the files lack, a shape mismatch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from iterserve.replica.model_source import is_gguf
from iterserve.replica.models import ModelConfig, build_model
from iterserve.replica.ops import Ops

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class GenerationConfig:
    """What generation_config.json says about stopping (and defaults the API may show)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_model_config(path: str | Path) -> ModelConfig:
    if is_gguf(path):
        from iterserve.replica.gguf_loader import gguf_model_config

        return gguf_model_config(path)
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint folder {path}")
    return ModelConfig.from_hf_config(read_json(config_file))


def read_generation_config(path: str | Path) -> GenerationConfig:
    """generation_config.json if present (eos_token_id may be an int or a list), else defaults.

    A GGUF file has none: its stopping ids come with its tokenizer metadata."""
    if is_gguf(path):
        return GenerationConfig()
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return GenerationConfig()
    raw = read_json(file)
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return GenerationConfig(
        eos_token_ids=tuple(int(i) for i in eos_ids),
        bos_token_id=raw.get("bos_token_id"),
        temperature=raw.get("temperature"),
        top_p=raw.get("top_p"),
        top_k=raw.get("top_k"),
    )


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, or every shard the index names."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {folder} names shard(s) not on disk: "
                                    f"{', '.join(missing)}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return shards
    raise FileNotFoundError(f"no weights in checkpoint folder {folder}: expected "
                            f"model.safetensors, or shards with {INDEX_FILE}")


def weight_files_of(path: str | Path) -> list[Path]:
    """The files the weights are read from: a GGUF file itself, or a folder's safetensors."""
    return [Path(path)] if is_gguf(path) else weight_files(path)


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in the files, one at a time to bound host memory. Each
    tensor is a view of the file's mapping (safetensors 0.8 copies nothing): the one copy is
    into the model's parameter."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # safe_open is not a mapping: keys() is required
                yield name, f.get_tensor(name)


def load_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device | str,
                    ops: Ops, copied: Callable[[int], None] | None = None
                    ) -> tuple[nn.Module, ModelConfig]:
    """Build the model for `path`'s config.json and fill it from its safetensors (or a GGUF).
    `copied(nbytes)` hears of every buffer written on the way besides the parameters."""
    if is_gguf(path):
        from iterserve.replica.gguf_loader import load_gguf_checkpoint

        return load_gguf_checkpoint(path, dtype, device, ops, copied)
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    model_config = read_model_config(folder)
    files = weight_files(folder)
    model = build_model(model_config, dtype, device, ops)
    with torch.no_grad():
        model.load_weights(iter_weights(files))
    return model, model_config


def load_dummy(path: str | Path, dtype: torch.dtype, device: torch.device | str, ops: Ops,
               seed: int = 0, copied: Callable[[int], None] | None = None
               ) -> tuple[nn.Module, ModelConfig]:
    """Build the model for `path`'s config.json with random weights (load_format="dummy").

    For benchmarks of large shapes: no safetensors are read, and the weights are drawn on the
    target device, so a 1B-parameter model is ready in seconds (nothing but the parameters is
    written: `copied` is never called).
    """
    model_config = read_model_config(path)
    model = build_model(model_config, dtype, device, ops)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model, model_config
