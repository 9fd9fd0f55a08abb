"""replica/cpu_elementwise.py (the engine's compiled RMSNorm, rotary, SiLU*mul on CPU) against
kernels/reference.py, as the model calls them: q and k strided views of the fused q/k/v rows."""

from __future__ import annotations

import logging

import pytest
import torch

from iterserve.kernels import reference as ref
from iterserve.replica import cpu_elementwise
from iterserve.replica.cpu_elementwise import COMPILED_FROM_TOKENS, CpuElementwise, joint_heads

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 9, 3, 64, 576, 1536  # SmolLM2-135M


def fused_qkv(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """(qkv rows, q view, k view), as LlamaAttention splits the fused projection."""
    qkv = torch.randn((tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM), generator=gen)
    q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return qkv, q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM)


@torch.inference_mode()
@pytest.mark.parametrize("tokens", [3, COMPILED_FROM_TOKENS, 200, 512])
def test_compiled_ops_match_the_reference(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ops = CpuElementwise("compiled")
    cos_sin = torch.randn((4096, HEAD_DIM), generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    qkv, q, k = fused_qkv(tokens, gen)
    want, want_q, want_k = fused_qkv(tokens, torch.Generator().manual_seed(tokens))
    want.copy_(qkv)
    ref.rotary_embedding(positions, want_q, want_k, cos_sin)
    ops.rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(qkv, want)  # rotated in place, bit-identical, v untouched
    x = torch.randn((tokens, 2 * INTERMEDIATE), generator=gen)
    assert torch.equal(ops.silu_and_mul(x), ref.silu_and_mul(x))
    hidden, residual = torch.randn((2, tokens, HIDDEN), generator=gen)
    weight = torch.randn(HIDDEN, generator=gen)
    got, got_sum = ops.fused_add_rms_norm(hidden, residual, weight, 1e-5)
    want_normed, want_sum = ref.fused_add_rms_norm(hidden, residual, weight, 1e-5)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got, want_normed, atol=1e-5, rtol=1e-5)  # summation order
    torch.testing.assert_close(ops.rms_norm(hidden, weight, 1e-5),
                               ref.rms_norm(hidden, weight, 1e-5), atol=1e-5, rtol=1e-5)
    assert ops.path == "compiled"  # no fallback


def test_query_and_key_heads_are_one_view_only_when_adjacent() -> None:
    _, q, k = fused_qkv(5, torch.Generator().manual_seed(0))
    heads = joint_heads(q, k)
    assert heads is not None and heads.shape == (5, HEADS + KV_HEADS, HEAD_DIM)
    assert torch.equal(heads[:, :HEADS], q) and torch.equal(heads[:, HEADS:], k)
    assert joint_heads(q, k.clone()) is None  # a separate tensor
    assert joint_heads(q, q[:, :KV_HEADS]) is None  # not after the query heads


def test_eager_mode_leaves_the_reference_ops() -> None:
    base = cpu_elementwise.Ops("torch", ref.write_kv_cache, ref.paged_attention, ref.rms_norm,
                               ref.fused_add_rms_norm, ref.rotary_embedding, ref.silu_and_mul)
    assert CpuElementwise("eager").ops(base) is base


def test_a_failing_compile_falls_back_to_eager_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(fn: object) -> object:
        def raise_(*args: object) -> None:
            raise RuntimeError("C++ compile failed")
        return raise_

    monkeypatch.setattr(cpu_elementwise, "compiled", broken)
    ops = CpuElementwise("compiled")
    x = torch.randn((COMPILED_FROM_TOKENS, 2 * INTERMEDIATE))
    with caplog.at_level(logging.WARNING, logger="iterserve.replica.cpu_elementwise"):
        for _ in range(2):
            assert torch.equal(ops.silu_and_mul(x), ref.silu_and_mul(x))
    assert ops.path == "eager (fallback: RuntimeError: C++ compile failed)"
    assert len(caplog.records) == 1
