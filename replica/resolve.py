"""Settings resolution: an EngineConfig with every "auto" made concrete, once.

    resolve_engine_config(EngineConfig(...), cuda_available) -> EngineConfig (frozen, resolved)

Made concrete: the model (a name or None -> the file or folder, replica/model_source.py), the
served model name, the device, the dtype, the attention backend, async scheduling (on exactly
when the model runs on CUDA), the CPU paths (oneDNN linears, SDPA prefill and block decode
attention, compiled elementwise ops on CPU), max_model_len (bounded by the model and its sliding window) and
max_num_batched_tokens. The deployment resolves its engine settings once on the driver and
passes the resolved config down; the engine resolves what it is given, which changes nothing
when it is already resolved (idempotent), so `/v1/models` shows the values the engine really
uses. The number of KV blocks is not resolved here: it needs the GPU (profiling) unless
num_gpu_blocks_override gives it. The load format ("auto") becomes the model file's own:
gguf or safetensors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from iterserve.replica.config import EngineConfig
from iterserve.replica.loader import read_model_config
from iterserve.replica.model_source import is_gguf, model_display_name, resolve_model_path

CPU_DTYPE = "float32"  # measured faster than bf16 on CPU (README: "CPU dtype")
CUDA_DTYPE = "bfloat16"


def resolve_engine_config(config: EngineConfig, cuda_available: bool | None = None,
                          model_files_here: bool = True) -> EngineConfig:
    """`config` with every auto and derived value filled; raises ValueError for settings
    that do not fit the model. cuda_available None asks torch (this process's GPUs).

    model_files_here False (the driver of a cluster deployment): a model that cannot be read
    from this machine (a path on the GPU nodes, the built-in model's package missing here)
    keeps its model-dependent values open; the engine resolves them where the files are.
    """
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    device = config.device if config.device != "auto" else ("cuda" if cuda_available else "cpu")
    on_cuda = device.startswith("cuda")
    dtype = config.dtype if config.dtype != "auto" else (CUDA_DTYPE if on_cuda else CPU_DTYPE)
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if on_cuda else "torch"
    overlap = config.async_scheduling
    if overlap is None:  # overlapping pays where a GPU runs apart from the CPU
        overlap = on_cuda and config.runner == "model"
    # The CPU paths' fast choices on CPU; on CUDA none of them runs (F.linear, Triton).
    config = dataclasses.replace(
        config, device=device, dtype=dtype, attention_backend=backend, async_scheduling=overlap,
        cpu_linear=_concrete(config.cpu_linear, "torch" if on_cuda else "onednn"),
        cpu_prefill_attention=_concrete(config.cpu_prefill_attention,
                                        "loop" if on_cuda else "sdpa"),
        cpu_decode_attention=_concrete(config.cpu_decode_attention,
                                       "loop" if on_cuda else "blocks"),
        cpu_elementwise=_concrete(config.cpu_elementwise, "eager" if on_cuda else "compiled"))
    try:
        model_path = resolve_model_path(config.model)
        model_config = read_model_config(model_path)
    except FileNotFoundError:
        if model_files_here:
            raise
        return config
    # Sliding-window attention is not implemented, so the window bounds the context.
    model_max_len = min(model_config.max_position_embeddings,
                        model_config.sliding_window or model_config.max_position_embeddings)
    scheduler = config.scheduler.resolved(model_max_len)
    model_config.verify_max_model_len(scheduler.max_model_len)
    return dataclasses.replace(
        config,
        model=str(model_path),
        served_model_name=config.served_model_name or model_display_name(model_path),
        load_format=resolve_load_format(config.load_format, model_path),
        scheduler=scheduler,
    )


def resolve_load_format(load_format: str, model_path: Path) -> str:
    """What the loader reads: "auto" is the file's own format; a format that the file is
    not is a ValueError (the loader picks by the file, so it would be silently ignored)."""
    found = "gguf" if is_gguf(model_path) else "safetensors"
    if load_format == "auto":
        return found
    if load_format in ("gguf", "safetensors") and load_format != found:
        raise ValueError(f"load_format {load_format!r} does not match the model {model_path} "
                         f"({found}); leave it auto")
    return load_format


def _concrete(value: str, auto: str) -> str:
    return auto if value == "auto" else value
