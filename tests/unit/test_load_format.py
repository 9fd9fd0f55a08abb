"""load_format is resolved like every other "auto": /v1/models shows what the loader read.

A GGUF file is "gguf", an HF folder "safetensors", "dummy" stays; naming a format that the
file is not fails at resolution (the loader picks by the file and would ignore it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from gguf_testlib import write_gguf

from iterserve.deploy.engine_client import LocalEngineClient
from iterserve.deploy.server import create_app
from iterserve.replica import AsyncLLMEngine, EngineConfig
from iterserve.replica.make_model import write_model
from iterserve.replica.resolve import resolve_engine_config


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = write_model(tmp_path_factory.mktemp("hf"), seed=3, arch="llama", preset="micro",
                         overrides={"rope_scaling": None, "intermediate_size": 192})
    return {"safetensors": folder,
            "gguf": write_gguf(folder, tmp_path_factory.mktemp("gguf") / "micro.gguf")}


def _resolved(model: Path, **kwargs: str) -> EngineConfig:
    return resolve_engine_config(EngineConfig.from_kwargs(model=str(model), **kwargs),
                                 cuda_available=False)


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_auto_becomes_the_files_own_format_in_v1_models(models: dict[str, Path],
                                                        kind: str) -> None:
    config = _resolved(models[kind])
    assert config.load_format == kind
    assert "auto" not in (config.dtype, config.device, config.attention_backend,
                          config.load_format)
    assert _resolved(models[kind], load_format=kind).load_format == kind
    engine = AsyncLLMEngine(EngineConfig.from_kwargs(model=str(models[kind]), device="cpu",
                                                     num_gpu_blocks_override=16))
    try:
        with TestClient(create_app(LocalEngineClient(engine))) as http:
            card = http.get("/v1/models").json()["data"][0]
        assert card["metadata"]["load_format"] == kind
    finally:
        engine.shutdown()


def test_dummy_stays_and_a_format_the_file_is_not_fails(models: dict[str, Path]) -> None:
    assert _resolved(models["safetensors"], load_format="dummy").load_format == "dummy"
    with pytest.raises(ValueError, match="does not match the model"):
        _resolved(models["safetensors"], load_format="gguf")
    with pytest.raises(ValueError, match="does not match the model"):
        _resolved(models["gguf"], load_format="safetensors")
    with pytest.raises(ValueError, match="unknown load_format"):
        EngineConfig.from_kwargs(load_format="pt")
