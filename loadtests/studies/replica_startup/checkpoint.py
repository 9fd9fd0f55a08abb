"""The start-up study's HF checkpoint (516M parameters, random bf16 weights, written once)
and the page-cache helpers that make a start cold or warm."""

from __future__ import annotations

import json
import os
from pathlib import Path

# A Llama of 516M parameters: hidden 1536, 20 layers, 12 query / 4 KV heads of 128, MLP 4096,
# the tiny model's 4101-token vocabulary (its tokenizer is what make_model writes).
SHAPE = {"hidden_size": 1536, "num_hidden_layers": 20, "num_attention_heads": 12,
         "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 4096,
         "torch_dtype": "bfloat16"}
NAME = "startup-bench-516m-v1"


def write_bench_checkpoint(folder: Path | None = None, seed: int = 0) -> Path:
    """The checkpoint's folder, written once (about 1.0 GB of bf16 safetensors)."""
    import torch
    from safetensors.torch import save_file

    from iterserve.replica.make_model import _weight_shape, cache_root, write_model
    from iterserve.replica.models.config import ModelConfig
    from iterserve.replica.models.llama import hf_weight_names

    folder = folder or cache_root() / NAME
    weights = folder / "model.safetensors"
    if weights.is_file():
        return folder
    write_model(folder, seed=seed, overrides=SHAPE, with_weights=False)
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in hf_weight_names(config):
        shape = _weight_shape(name, config)
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    partial = folder / "model.safetensors.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    partial.rename(weights)
    return folder


def model_files(model: str) -> list[Path]:
    """Every file a start reads: the GGUF file, or every file of the folder."""
    path = Path(model)
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


def drop_page_cache(files: list[Path]) -> None:
    """Cold: ask the kernel to drop the files' clean pages (POSIX_FADV_DONTNEED)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(files: list[Path]) -> None:
    """Warm: read every byte once, so the start finds the files in the page cache."""
    for file in files:
        with open(file, "rb") as f:
            while f.read(16 << 20):
                pass
