"""A PEFT LoRA adapter read from a local folder and checked against the base model.

A PEFT adapter is `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` holding, per adapted linear, `lora_A.weight` [r, in] and
`lora_B.weight` [out, r] under names like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`. The adapted linear computes
`W x + B (A x) * scaling` with scaling = lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).

What this engine cannot apply is refused here, at load, with the reason (`LoRALoadError`): a
missing or malformed file, a rank above `max_lora_rank`, a target the base model lacks, a
tensor of the wrong shape, and PEFT features beyond plain LoRA (DoRA, biases, per-module
ranks, extra trained modules). Nothing is half-loaded.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from iterserve.replica.models.config import ModelConfig

# The HF projections an adapter may target, with the input and output sizes each has.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json keys whose non-default values change the arithmetic we would apply.
_REFUSED_FEATURES = {"use_dora": False, "fan_in_fan_out": False, "rank_pattern": {},
                     "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None}


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter as it travels to a replica (vLLM's LoRARequest): its model name
    and its folder, so a replica that does not serve it yet (started after the adapter was
    loaded, or restarted) reads it from there before admitting the request. `version`: the
    runtime load it was admitted with (0: a lora_modules adapter), which a replica checks is
    still loaded before reading the adapter back (deploy/lora_registry.py)."""

    name: str
    path: str
    version: int = 0


# Whether a request's adapter version is still loaded in the cluster (the ingress's registry):
# asked before a replica reads an adapter back.
LoRACheck = Callable[[LoRARequest], Awaitable[bool]]


class LoRALoadError(ValueError):
    """An adapter that cannot be served, and why (the API answers it with a 400)."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in host memory: per (layer, HF projection) its A [r, in] and its B [out, r]
    with the scaling folded in (so applying it is two matmuls)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of an HF projection of this model."""
    shapes = {"q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
              "v_proj": (cfg.hidden_size, cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    return shapes[target]


def load_lora_adapter(name: str, path: str | Path, cfg: ModelConfig,
                      max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter in folder `path` for a model of config `cfg`."""
    folder = Path(path)
    settings = _read_config(name, folder)
    rank = settings.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRALoadError(f"adapter {name!r}: adapter_config.json needs a positive integer "
                            f"'r', got {rank!r}")
    if rank > max_rank:
        raise LoRALoadError(f"adapter {name!r} has rank {rank}, above max_lora_rank={max_rank}")
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise LoRALoadError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    _check_plain_lora(name, settings)
    _check_targets(name, settings.get("target_modules"))
    tensors = _read_tensors(name, folder)
    weights = _pair_tensors(name, tensors, cfg, rank, scaling)
    return LoRAAdapter(name=name, path=str(folder), rank=rank, weights=weights)


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise LoRALoadError(f"adapter {name!r}: no adapter_config.json in {str(folder)!r}")
    try:
        settings = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LoRALoadError(f"adapter {name!r}: adapter_config.json is not valid JSON "
                            f"({error})") from error
    if not isinstance(settings, dict):
        raise LoRALoadError(f"adapter {name!r}: adapter_config.json must hold a JSON object")
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRALoadError(f"adapter {name!r}: peft_type {peft_type!r} is not LORA")
    return settings


def _check_plain_lora(name: str, settings: dict[str, Any]) -> None:
    if settings.get("bias", "none") != "none":
        raise LoRALoadError(f"adapter {name!r}: bias={settings['bias']!r} is not supported "
                            "(only 'none')")
    for key, plain in _REFUSED_FEATURES.items():
        if settings.get(key, plain) not in (plain, None, {}, False):
            raise LoRALoadError(f"adapter {name!r}: {key}={settings[key]!r} is not supported")


def _check_targets(name: str, targets: object) -> None:
    if targets == "all-linear" or targets is None:
        return  # the tensors say which; each is checked against the model below
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list):
        raise LoRALoadError(f"adapter {name!r}: target_modules must be a list, got {targets!r}")
    unknown = sorted(str(t) for t in targets if t not in SUPPORTED_TARGETS)
    if unknown:
        raise LoRALoadError(f"adapter {name!r} targets {', '.join(unknown)}, which the model "
                            f"lacks or LoRA here does not adapt (supported: "
                            f"{', '.join(SUPPORTED_TARGETS)})")


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRALoadError(f"adapter {name!r}: no adapter_model.safetensors in {str(folder)!r}")
    try:
        return load_file(str(weights_file))
    except Exception as error:  # noqa: BLE001 - safetensors raises its own and OS errors
        raise LoRALoadError(f"adapter {name!r}: adapter_model.safetensors cannot be read "
                            f"({error})") from error


def _pair_tensors(name: str, tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                  scaling: float) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_NAME.match(key)
        if match is None:
            raise LoRALoadError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of "
                                "a decoder layer's projection")
        layer, target, half = int(match[1]), match[3], match[4]
        if target not in SUPPORTED_TARGETS:
            raise LoRALoadError(f"adapter {name!r}: tensor {key!r} targets {target}, which the "
                                "model lacks")
        if layer >= cfg.num_hidden_layers:
            raise LoRALoadError(f"adapter {name!r}: tensor {key!r} is for layer {layer}, the "
                                f"model has {cfg.num_hidden_layers}")
        halves.setdefault((layer, target), {})[half] = tensor
    if not halves:
        raise LoRALoadError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        where = f"layer {layer} {target}"
        if set(pair) != {"A", "B"}:
            raise LoRALoadError(f"adapter {name!r}: {where} has lora_{''.join(pair)} alone")
        fan_in, fan_out = projection_shape(cfg, target)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRALoadError(
                f"adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the model needs {(rank, fan_in)} and {(fan_out, rank)}")
        weights[(layer, target)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return weights
