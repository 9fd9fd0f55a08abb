"""iterserve.kernels.ops must be a drop-in for iterserve.kernels.reference."""

from __future__ import annotations

import inspect

import pytest

from iterserve.kernels import ops
from iterserve.kernels import reference as ref

SWAPPABLE = [
    "write_kv_cache",
    "paged_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]


@pytest.mark.parametrize("name", SWAPPABLE)
def test_launcher_takes_the_reference_arguments(name: str) -> None:
    want = inspect.signature(getattr(ref, name)).parameters
    got = inspect.signature(getattr(ops, name)).parameters
    # Same positional parameters, in order; anything extra is keyword-only and optional.
    assert list(got)[: len(want)] == list(want)
    for extra in list(got)[len(want) :]:
        assert got[extra].kind is inspect.Parameter.KEYWORD_ONLY
        assert got[extra].default is not inspect.Parameter.empty


def test_split_kv_matches_its_reference_signature() -> None:
    want = list(inspect.signature(ref.paged_decode_attention).parameters)
    got = inspect.signature(ops.paged_decode_attention_split_kv).parameters
    assert list(got)[: len(want)] == want
    assert got["num_splits"].default is None
    assert set(ops.__all__) >= {*SWAPPABLE, "paged_decode_attention_split_kv", "use_split_kv"}
