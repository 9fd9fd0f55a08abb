"""Rotary position embedding tables, with Llama 3 and linear context scaling.

The formulas follow transformers' modeling_rope_utils so fp32 logits match HF's closely.
"""

from __future__ import annotations

import math

import torch

from iterserve.replica.models.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim / 2] float32 rotation speeds, scaled for extended context."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [D/2]
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Low frequencies (long wavelengths) are slowed by `factor`, high ones kept, and the band
    # in between interpolated smoothly, so short-range behaviour is the pretrained one.
    old_len = scaling.original_max_position_embeddings
    if old_len is None:
        raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(
    head_dim: int, theta: float, scaling: RopeScaling, max_positions: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [max_positions, head_dim] float32: cos in [:, :D/2], sin in [:, D/2:]
    """The table kernels/reference.rotary_embedding indexes by position."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)  # [D/2]
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)  # [P]
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
