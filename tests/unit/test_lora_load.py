"""Adapters that cannot be served are refused at load, naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from iterserve.replica.loader import read_model_config
from iterserve.replica.lora_adapter import LoRALoadError, load_lora_adapter
from iterserve.replica.make_model import write_model
from iterserve.replica.models.config import ModelConfig

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return read_model_config(write_model(tmp_path_factory.mktemp("base"), seed=3))


def write_adapter(folder: Path, cfg: ModelConfig, rank: int = 4, targets: list[str] | None = None,
                  config: dict | None = None, shapes: dict[str, tuple[int, int]] | None = None
                  ) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    targets = targets or ["q_proj"]
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": targets,
                "bias": "none", **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    tensors = {}
    for target in targets:
        shape_a = (shapes or {}).get("A", (rank, cfg.hidden_size))
        shape_b = (shapes or {}).get("B", (cfg.q_size, rank))
        tensors[f"{PREFIX}.0.self_attn.{target}.lora_A.weight"] = torch.ones(shape_a)
        tensors[f"{PREFIX}.0.self_attn.{target}.lora_B.weight"] = torch.ones(shape_b)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_a_good_adapter_loads_with_scaling_folded_in(tmp_path: Path, cfg: ModelConfig) -> None:
    adapter = load_lora_adapter("ok", write_adapter(tmp_path / "ok", cfg), cfg, max_rank=16)
    a, b = adapter.weights[(0, "q_proj")]
    assert adapter.rank == 4 and a.shape == (4, cfg.hidden_size)
    assert float(b[0, 0]) == 2.0  # lora_alpha / r = 8 / 4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank": 32}, "rank 32, above max_lora_rank=16"),
    ({"targets": ["embed_tokens"]}, "targets embed_tokens, which the model lacks"),
    ({"config": {"use_dora": True}}, "use_dora=True is not supported"),
    ({"config": {"bias": "all"}}, "bias='all' is not supported"),
    ({"config": {"r": "eight"}}, "positive integer 'r'"),
    ({"shapes": {"B": (7, 4)}}, "the model needs"),
])
def test_bad_adapters_are_refused_naming_the_problem(tmp_path: Path, cfg: ModelConfig,
                                                      kwargs: dict, message: str) -> None:
    folder = write_adapter(tmp_path / "bad", cfg, **kwargs)
    with pytest.raises(LoRALoadError, match=message):
        load_lora_adapter("bad", folder, cfg, max_rank=16)


def test_missing_and_malformed_files(tmp_path: Path, cfg: ModelConfig) -> None:
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        load_lora_adapter("x", tmp_path, cfg, max_rank=16)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRALoadError, match="not valid JSON"):
        load_lora_adapter("x", tmp_path, cfg, max_rank=16)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(LoRALoadError, match="no adapter_model.safetensors"):
        load_lora_adapter("x", tmp_path, cfg, max_rank=16)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoRALoadError, match="cannot be read"):
        load_lora_adapter("x", tmp_path, cfg, max_rank=16)
