"""Write a deterministic tiny HF-format checkpoint, with no transformers import.

    python -m iterserve.replica.make_model DIR --seed 0 [--arch llama|qwen2|mistral] [--preset tiny]

The folder holds config.json, model.safetensors (random weights from torch.Generator(seed),
HF tensor names), generation_config.json, and the byte-level BPE tokenizer committed in
replica/assets/ with a Llama-3-style chat template. `default_model_path()` builds the default
model once into a cache folder and returns it.

    python -m iterserve.replica.make_model --train-tokenizer replica/assets/tokenizer.json

re-trains that tokenizer from Python standard-library docstrings (PSF-licensed text).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from iterserve.replica.models.config import ModelConfig
from iterserve.replica.models.llama import hf_weight_names

ASSETS = Path(__file__).parent / "assets"
TOKENIZER_FILE = ASSETS / "tokenizer.json"
# Bump when the weights or files make_model writes change, so stale caches are not reused.
FORMAT_VERSION = 1
DEFAULT_ARCH, DEFAULT_PRESET, DEFAULT_SEED = "llama", "tiny", 0

BOS, EOS_TEXT, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIAL_TOKENS = (BOS, EOS_TEXT, "<|start_header_id|>", "<|end_header_id|>", EOT)
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int


PRESETS = {
    # A few ms per decode step on CPU; serves prompts up to 4k tokens.
    "tiny": Preset(256, 4, 8, 4, 32, 688, 4096),
    # For unit tests: the smallest shapes that still have GQA and several layers.
    "micro": Preset(64, 2, 4, 2, 16, 176, 1024),
    "small": Preset(512, 8, 8, 2, 64, 1376, 4096),
}

ARCHES: dict[str, dict[str, Any]] = {
    # Llama 3.1 style: large theta, llama3 rope scaling, untied head.
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": False},
    # Qwen2 (7B) style: q/k/v bias, a window that is configured but unused. Untied: with tied
    # random embeddings greedy decoding just repeats the last token (its own logit dominates).
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "rope_theta": 1000000.0, "tie_word_embeddings": False,
              "use_sliding_window": False, "max_window_layers": 2},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False},
}


def default_model_name(arch: str = DEFAULT_ARCH, preset: str = DEFAULT_PRESET) -> str:
    return f"iterserve-{preset}-{arch}-v{FORMAT_VERSION}"


def load_tokenizer_json() -> dict[str, Any]:
    with open(TOKENIZER_FILE, encoding="utf-8") as f:
        return json.load(f)


def special_token_ids(tokenizer_json: dict[str, Any]) -> dict[str, int]:
    return {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}


def hf_config(arch: str, preset: str, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """config.json as transformers writes it (4.x spelling, which 5.x still reads)."""
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[preset]
    config: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size, "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads, "head_dim": p.head_dim,
        "max_position_embeddings": p.max_position_embeddings, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "initializer_range": 0.02, "rope_scaling": None,
        "bos_token_id": ids[BOS], "eos_token_id": [ids[EOT], ids[EOS_TEXT]],
        "torch_dtype": "float32", "use_cache": True, "attention_dropout": 0.0,
    }
    config.update(ARCHES[arch])
    if arch == "llama":
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
        }
    if arch == "qwen2":
        config["sliding_window"] = p.max_position_embeddings
        config["max_window_layers"] = p.num_hidden_layers
    return config


def _weight_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    projection = name.rsplit(".", 2)[-2]
    out_features = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size,
                    "o_proj": h, "gate_proj": i, "up_proj": i, "down_proj": h}
    in_features = {"o_proj": cfg.q_size, "down_proj": i}
    if name.endswith("norm.weight"):
        return (h,)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, h)
    if name.endswith(".bias"):
        return (out_features[projection],)
    return (out_features[projection], in_features.get(projection, h))


def _weight_std(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> float:
    # Large embedding and head scales give logits a spread of several units, so greedy
    # decoding has clearly separated winners (no near-ties between implementations).
    # Projections use 1/sqrt(fan_in) so every layer moves the residual stream; the output
    # projections are damped by the depth so the stream stays bounded.
    if name == "model.embed_tokens.weight":
        return 1.0
    if name == "lm_head.weight":
        return 8.0 / cfg.hidden_size**0.5
    if name.endswith(".bias"):
        return 0.1
    std = shape[1] ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= (2 * cfg.num_hidden_layers) ** 0.5
    return std


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors, a pure function of (config, seed)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name in hf_weight_names(cfg):  # a fixed order, so the draws are reproducible
        shape = _weight_shape(name, cfg)
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            std = _weight_std(name, shape, cfg)
            weights[name] = torch.randn(shape, generator=generator) * std
    return weights


def tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOT, "pad_token": EOS_TEXT,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": tok, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False} for tok, i in ids.items()
        },
    }


def write_model(out_dir: str | Path, seed: int = DEFAULT_SEED, arch: str = DEFAULT_ARCH,
                preset: str = DEFAULT_PRESET, overrides: dict[str, Any] | None = None,
                with_weights: bool = True) -> Path:
    """Write the checkpoint folder (created if needed) and return its path.

    `overrides` patches config.json (e.g. {"tie_word_embeddings": True}) before the weights
    are drawn, for tests of variants the presets do not cover. `with_weights=False` writes
    everything but the safetensors, for engines run with load_format="dummy".
    """
    out = Path(out_dir)
    tokenizer_json = load_tokenizer_json()
    ids = special_token_ids(tokenizer_json)
    vocab_size = len(tokenizer_json["model"]["vocab"]) + len(
        [t for t in tokenizer_json["added_tokens"] if t["content"] not in
         tokenizer_json["model"]["vocab"]])
    config = {**hf_config(arch, preset, vocab_size, ids), **(overrides or {})}
    out.mkdir(parents=True, exist_ok=True)
    if with_weights:
        weights = random_weights(ModelConfig.from_hf_config(config), seed)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[BOS], "eos_token_id": [ids[EOT], ids[EOS_TEXT]],
        "do_sample": False,
    })
    _write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    shutil.copyfile(TOKENIZER_FILE, out / "tokenizer.json")
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def cache_root() -> Path:
    """$ITERSERVE_CACHE if set, else ~/.cache/iterserve."""
    env = os.environ.get("ITERSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "iterserve"


def default_model_path(arch: str = DEFAULT_ARCH, preset: str = DEFAULT_PRESET,
                       seed: int = DEFAULT_SEED) -> Path:
    """The built-in model's folder, written on first use.

    Built in a temporary sibling folder and renamed into place, so concurrent first uses
    (several replicas, several test workers) never see a half-written checkpoint.
    """
    final = cache_root() / "models" / f"{default_model_name(arch, preset)}-seed{seed}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write_model(tmp, seed=seed, arch=arch, preset=preset)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        os.rename(tmp, final)
    except OSError:
        # Another process renamed its copy into place first; use that one.
        if not final.is_dir():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


# Python standard-library modules whose docstrings are the tokenizer's training text.
CORPUS_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools",
    "heapq", "http.client", "inspect", "io", "itertools", "json", "logging", "math", "os",
    "pathlib", "pickle", "pydoc", "queue", "random", "re", "shutil", "socket", "statistics",
    "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "zipfile",
)
VOCAB_SIZE = 4096
# Llama 3's pre-tokenizer split: contractions, words, 1-3 digit groups, punctuation, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def corpus_texts() -> list[str]:
    """Docstrings of CORPUS_MODULES and their public members, in a fixed order."""
    import importlib
    import inspect

    texts = []
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        texts.append(inspect.getdoc(module) or "")
        for name in sorted(vars(module)):
            doc = None if name.startswith("_") else inspect.getdoc(getattr(module, name))
            if doc:
                texts.append(doc)
    return texts


def train_tokenizer(path: Path) -> None:
    """Train the byte-level BPE (Llama 3 layout) and write tokenizer.json to `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus_texts(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", help="output checkpoint folder")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the random weights")
    parser.add_argument("--arch", choices=sorted(ARCHES), default=DEFAULT_ARCH,
                        help="model family whose config and tensor names the checkpoint uses")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                        help="size preset (layers, hidden size, heads, vocabulary)")
    parser.add_argument("--train-tokenizer", metavar="PATH",
                        help="re-train the byte-level BPE tokenizer into PATH and exit")
    args = parser.parse_args(argv)
    if args.train_tokenizer:
        train_tokenizer(Path(args.train_tokenizer))
        return
    if not args.dir:
        parser.error("DIR is required")
    print(write_model(args.dir, seed=args.seed, arch=args.arch, preset=args.preset))


if __name__ == "__main__":
    main()
