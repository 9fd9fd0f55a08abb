"""load_checkpoint: single and sharded safetensors, and errors that name what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from iterserve.replica.loader import (
    INDEX_FILE,
    load_checkpoint,
    read_generation_config,
    read_model_config,
    weight_files,
)
from iterserve.replica.make_model import write_model
from iterserve.replica.ops import select_ops

OPS = select_ops("torch")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("src"), seed=0, arch="qwen2", preset="micro")


@pytest.fixture()
def ckpt(source: Path, tmp_path: Path) -> Path:
    """A private copy each test may break."""
    return Path(shutil.copytree(source, tmp_path / "ckpt"))


def shard(folder: Path, num_shards: int = 3) -> dict[str, str]:
    """Rewrite model.safetensors as HF-style shards with an index."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for k in range(num_shards):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::num_shards]}
        save_file(part, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_loads_single_file_and_stacks_qkv(ckpt):
    model, cfg = load_checkpoint(ckpt, torch.float32, "cpu", OPS)
    tensors = load_file(ckpt / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj
    prefix = "model.layers.1.self_attn."
    expected = torch.cat([tensors[prefix + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.weight, expected)
    bias = torch.cat([tensors[prefix + p + ".bias"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(qkv.bias, bias)
    gate_up = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up[: cfg.intermediate_size], tensors["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(gate_up[cfg.intermediate_size:], tensors["model.layers.0.mlp.up_proj.weight"])


def test_sharded_checkpoint_loads_the_same_weights(ckpt, source):
    shard(ckpt)
    assert len(weight_files(ckpt)) == 3
    sharded, _ = load_checkpoint(ckpt, torch.float32, "cpu", OPS)
    single, _ = load_checkpoint(source, torch.float32, "cpu", OPS)
    a, b = state(sharded), state(single)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_casts_to_requested_dtype(ckpt):
    model, _ = load_checkpoint(ckpt, torch.bfloat16, "cpu", OPS)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", torch.float32, "cpu", OPS)


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(ckpt, torch.float32, "cpu", OPS)


def test_invalid_config_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        read_model_config(ckpt)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights .*model\.safetensors"):
        load_checkpoint(ckpt, torch.float32, "cpu", OPS)


def test_index_naming_a_missing_shard(ckpt):
    weight_map = shard(ckpt)
    lost = sorted(set(weight_map.values()))[1]
    (ckpt / lost).unlink()
    with pytest.raises(FileNotFoundError, match=lost):
        load_checkpoint(ckpt, torch.float32, "cpu", OPS)


def test_missing_tensors_are_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"], tensors["lm_head.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 2 tensor\(s\): lm_head.weight, "
                                         r"model.layers.1.self_attn.k_proj.bias"):
        load_checkpoint(ckpt, torch.float32, "cpu", OPS)


def test_shape_mismatch_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight.*\(3, 3\)"):
        load_checkpoint(ckpt, torch.float32, "cpu", OPS)


def test_unused_tensors_are_ignored(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, str(ckpt / "model.safetensors"))
    load_checkpoint(ckpt, torch.float32, "cpu", OPS)


def test_tied_checkpoint_needs_no_lm_head(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (ckpt / "config.json").write_text(json.dumps(config))
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    model, _ = load_checkpoint(ckpt, torch.float32, "cpu", OPS)
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize(("eos", "expected"), [(7, (7,)), ([7, 9], (7, 9)), (None, ())])
def test_generation_config_eos_int_or_list(tmp_path, eos, expected):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos,
                                                                 "temperature": 0.6}))
    generation = read_generation_config(tmp_path)
    assert generation.eos_token_ids == expected and generation.temperature == 0.6


def test_generation_config_absent_gives_defaults(tmp_path):
    assert read_generation_config(tmp_path).eos_token_ids == ()
