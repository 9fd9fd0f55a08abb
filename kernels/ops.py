"""The Triton launchers under the names of iterserve.kernels.reference, so the two swap.

Every launcher takes the reference function's arguments (some add keyword-only launch hints
and `out=` for preallocated outputs). The split-KV decode path and its heuristics have no
reference twin with the same name: reference.paged_decode_attention computes the same result.
"""

from __future__ import annotations

from iterserve.kernels.activation import silu_and_mul
from iterserve.kernels.attention_core import SUPPORTED_HEAD_DIMS, check_head_dim
from iterserve.kernels.kv_cache import write_kv_cache
from iterserve.kernels.norm import fused_add_rms_norm, rms_norm
from iterserve.kernels.paged_attention import paged_attention
from iterserve.kernels.rotary import rotary_embedding
from iterserve.kernels.split_kv import (
    choose_num_splits,
    paged_decode_attention_split_kv,
    use_split_kv,
)

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "check_head_dim",
    "choose_num_splits",
    "fused_add_rms_norm",
    "paged_attention",
    "paged_decode_attention_split_kv",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "use_split_kv",
    "write_kv_cache",
]
