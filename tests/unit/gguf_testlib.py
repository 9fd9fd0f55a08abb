"""Write small GGUF files the way llama.cpp's converter does, from a make_model checkpoint.

The Q and K rows are permuted as `convert_hf_to_gguf.py`'s `LlamaModel.permute` does, the
tensors renamed to llama.cpp's names, and the tokenizer written as `tokenizer.ggml.*` metadata,
so the loader under test meets the same layout as in a real file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from iterserve.replica.gguf_loader import GLOBAL_TENSORS, LAYER_TENSORS


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permute: HF halves -> interleaved pairs, per head."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf_name: str) -> str:
    for gguf_key, hf_key in GLOBAL_TENSORS.items():
        if hf_name == hf_key:
            return gguf_key
    _, _, layer, rest = hf_name.split(".", 3)
    gguf_key = next(k for k, v in LAYER_TENSORS.items() if v == rest)
    return f"blk.{layer}.{gguf_key}"


def write_gguf(folder: Path, out: Path, arch: str = "llama", tokenizer_model: str = "gpt2",
               tensor_type: str = "F32", truncate_to: int | None = None,
               extra_kv: dict[str, Any] | None = None) -> Path:
    """A GGUF file holding `folder`'s checkpoint (a make_model llama folder)."""
    config = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = dict(tokenizer["model"]["vocab"])
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"][0])
    writer.add_add_bos_token(True)
    writer.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())
                             ["chat_template"])
    for key, value in (extra_kv or {}).items():
        writer.add_string(key, value)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, tensor in weights.items():
        if name.endswith("q_proj.weight"):
            tensor = llama_cpp_permute(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = llama_cpp_permute(tensor, kv_heads)
        if tensor.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(tensor, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F64:
            writer.add_tensor(gguf_name(name), tensor.astype(np.float64))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(tensor, dtype=np.float32), qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate_to is not None:
        with open(out, "r+b") as f:
            f.truncate(truncate_to)
    return out
