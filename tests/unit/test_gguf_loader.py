"""GGUF loading on small files written here as llama.cpp's converter writes them.

A make_model checkpoint is written to GGUF (Q/K rows permuted, llama.cpp names, tokenizer as
metadata) and loaded back: at F32 the engine's greedy tokens and the tokenizer's ids equal the
safetensors folder's; quantized types dequantize close to the originals; unsupported
architectures, tensor types and tokenizer models, and truncated files, fail at load with a
ValueError that names them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_testlib import write_gguf
from safetensors.torch import load_file

from iterserve.replica import LLM, SamplingParams
from iterserve.replica.gguf_loader import (
    SUPPORTED_TENSOR_TYPES,
    gguf_model_config,
    iter_gguf_weights,
)
from iterserve.replica.loader import read_model_config
from iterserve.replica.make_model import write_model
from iterserve.replica.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TEXTS = ["Hello world", "def f(x):\n    return x  # 42\n", "ünïcödé 日本 🤖", "a    b\t\t\n\nc 12345"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # No llama3 rope scaling (the GGUF writer here writes none) and an FFN width that is a
    # multiple of 32, the block size of the legacy quant types.
    return write_model(tmp_path_factory.mktemp("hf"), seed=3, arch="llama", preset="micro",
                       overrides={"rope_scaling": None, "intermediate_size": 192})


@pytest.fixture(scope="module")
def f32_file(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(folder, tmp_path_factory.mktemp("gguf") / "micro.gguf")


def test_config_from_metadata_matches_config_json(folder: Path, f32_file: Path) -> None:
    ours, reference = gguf_model_config(f32_file), read_model_config(folder)
    # GGUF stores the epsilon as float32, and one EOS id (the tokenizer adds the rest).
    assert ours.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert set(ours.eos_token_ids) < set(reference.eos_token_ids)
    same = {"rms_norm_eps": reference.rms_norm_eps, "eos_token_ids": reference.eos_token_ids}
    assert dataclasses.replace(ours, **same) == reference


def test_f32_gguf_generates_what_the_folder_generates(folder: Path, f32_file: Path) -> None:
    prompts = [[5, 6, 7], list(range(20, 60)), [9] * 3]
    kwargs = {"dtype": "float32", "max_num_batched_tokens": 32}
    want = [r.outputs[0].token_ids for r in LLM(str(folder), **kwargs).generate(prompts, GREEDY)]
    llm = LLM(str(f32_file), **kwargs)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    assert got == want
    assert llm.engine.model_name == "micro"


def test_tokenizer_from_metadata_matches_tokenizer_json(folder: Path, f32_file: Path) -> None:
    ours, reference = Tokenizer.from_pretrained(f32_file), Tokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)  # BOS added: add_bos_token
        assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages)
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_ids <= reference.eos_token_ids and ours.eos_token_ids
    assert ours.all_special_ids == reference.all_special_ids


# Worst element error relative to the tensor's largest magnitude, per type.
TOLERANCE = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_0": 0.05, "Q5_1": 0.05,
             "Q4_0": 0.1, "Q4_1": 0.1}


@pytest.mark.parametrize("tensor_type", sorted(TOLERANCE))
def test_quantized_types_dequantize_close(folder: Path, tmp_path: Path, tensor_type: str) -> None:
    file = write_gguf(folder, tmp_path / f"{tensor_type}.gguf", tensor_type=tensor_type)
    original = load_file(str(folder / "model.safetensors"))
    config = gguf_model_config(file)
    seen = 0
    for name, weight in iter_gguf_weights(file, config):
        tensor = torch.empty(weight.shape)
        weight.write_into(tensor)
        want = original[name]
        error = (tensor - want).abs().max() / want.abs().max()
        assert error <= TOLERANCE[tensor_type], (name, float(error))
        seen += 1
    assert seen == len(original)


def test_unsupported_architecture_is_named(folder: Path, tmp_path: Path) -> None:
    file = write_gguf(folder, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2'.*supported: llama, mistral, qwen2"):
        LLM(str(file))


def test_unsupported_tokenizer_model_is_named(folder: Path, tmp_path: Path) -> None:
    file = write_gguf(folder, tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(ValueError, match=r"tokenizer model 'llama'.*supported: gpt2"):
        Tokenizer.from_pretrained(file)


def test_unsupported_tensor_type_is_named(folder: Path, tmp_path: Path) -> None:
    file = write_gguf(folder, tmp_path / "f64.gguf", tensor_type="F64")
    with pytest.raises(ValueError, match=r"type F64.*supported: F32, F16") as error:
        LLM(str(file))
    assert all(kind in str(error.value) for kind in SUPPORTED_TENSOR_TYPES)


def test_truncated_and_foreign_files_fail_at_load(folder: Path, f32_file: Path,
                                                  tmp_path: Path) -> None:
    size = f32_file.stat().st_size
    for cut in (size - 1000, 2000, 10):
        file = write_gguf(folder, tmp_path / f"cut{cut}.gguf", truncate_to=cut)
        with pytest.raises(ValueError, match="truncated or corrupt|not a GGUF"):
            LLM(str(file))
    foreign = tmp_path / "model.gguf"
    foreign.write_bytes(np.arange(100, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(foreign))
