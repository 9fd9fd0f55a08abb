"""RMSNorm, fused add + RMSNorm, rotary embedding and SiLU-and-mul against reference.py."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE, TOLERANCES, poisoned

from iterserve.kernels import _common, ops
from iterserve.kernels import reference as ref

DTYPES = [torch.float32, torch.float16]


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a non-power-of-2 row, masked lanes
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    # Rows are a strided view (every other row of a wider buffer): the kernel must use stride.
    base = _randn(10, hidden + 32, dtype=dtype)
    x = base[::2, :hidden]
    weight = _randn(hidden, dtype=dtype, seed=1)
    out = poisoned((5, hidden), dtype)
    got = ops.rms_norm(x, weight, 1e-6, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, ref.rms_norm(x, weight, 1e-6), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    hidden = 80
    x = _randn(7, hidden, dtype=dtype)
    residual = _randn(7, hidden, dtype=dtype, seed=1)
    weight = _randn(hidden, dtype=dtype, seed=2)
    want_normed, want_sum = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    normed, summed = ops.fused_add_rms_norm(
        x, residual, weight, 1e-5, out=poisoned(x.shape, dtype), residual_out=poisoned(x.shape, dtype)
    )
    torch.testing.assert_close(summed, want_sum, atol=0, rtol=0)  # same fp32 add, same rounding
    torch.testing.assert_close(normed, want_normed, **TOLERANCES[dtype])


def test_fused_add_rms_norm_in_place_residual() -> None:
    x = _randn(4, 64, dtype=torch.float32)
    residual = _randn(4, 64, dtype=torch.float32, seed=1)
    weight = _randn(64, dtype=torch.float32, seed=2)
    want_normed, want_sum = ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    normed, summed = ops.fused_add_rms_norm(x, residual, weight, 1e-6, residual_out=residual)
    assert summed.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(residual, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = _randn(6, 2 * 72, dtype=dtype) * 4  # large magnitudes reach the exp overflow branch
    x[0, 0] = -200.0
    out = ops.silu_and_mul(x, out=poisoned((6, 72), dtype))
    torch.testing.assert_close(out, ref.silu_and_mul(x), **TOLERANCES[dtype])


def _cos_sin_cache(max_pos: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_on_fused_qkv_views(dtype: torch.dtype, head_dim: int) -> None:
    num_tokens, num_heads, num_kv_heads = 5, 8, 2
    # q and k are strided views into one fused qkv projection, as the model produces them.
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(num_tokens, width, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k_end = (num_heads + num_kv_heads) * head_dim
    k = qkv[:, num_heads * head_dim : k_end].view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, k_end:].clone()
    q_before = q.clone()
    positions = torch.tensor([0, 5, 17, 3, 63], device=DEVICE)
    cache = _cos_sin_cache(64, head_dim)
    q_want, k_want = q.clone(), k.clone()
    ref.rotary_embedding(positions, q_want, k_want, cache)
    ops.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q, q_want, **TOLERANCES[dtype])
    torch.testing.assert_close(k, k_want, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, k_end:], v_before)  # v untouched
    # Position 0 is the identity rotation; the others must have moved (not a no-op kernel).
    assert not torch.allclose(q[1:], q_before[1:])


def test_rotary_many_heads_loops_over_head_tiles() -> None:
    # 40 heads x D=128 exceeds one head tile (2048 // 64 = 32 heads), so the loop runs twice.
    q = _randn(3, 40, 128, dtype=torch.float32)
    k = _randn(3, 8, 128, dtype=torch.float32, seed=1)
    positions = torch.tensor([1, 2, 30], device=DEVICE)
    cache = _cos_sin_cache(32, 128)
    q_want, k_want = q.clone(), k.clone()
    ref.rotary_embedding(positions, q_want, k_want, cache)
    ops.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q, q_want, **TOLERANCES[torch.float32])
    torch.testing.assert_close(k, k_want, **TOLERANCES[torch.float32])


def test_empty_batches() -> None:
    weight = _randn(64, dtype=torch.float32)
    assert ops.rms_norm(_randn(0, 64, dtype=torch.float32), weight, 1e-6).shape == (0, 64)
    assert ops.silu_and_mul(_randn(0, 64, dtype=torch.float32)).shape == (0, 32)
    q, k = _randn(0, 4, 64, dtype=torch.float32), _randn(0, 2, 64, dtype=torch.float32)
    ops.rotary_embedding(torch.zeros(0, dtype=torch.long, device=DEVICE), q, k, _cos_sin_cache(4, 64))


def test_validation_raises_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _randn(4, 64, dtype=torch.float32)
    w = _randn(64, dtype=torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.rms_norm(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        ops.rms_norm(x.double(), w, 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        ops.rms_norm(_randn(64, 4, dtype=torch.float32).t(), w, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        ops.rms_norm(x, w, 0.0)
    with pytest.raises(ValueError, match="residual must have shape"):
        ops.fused_add_rms_norm(x, x[:2], w, 1e-6)
    with pytest.raises(ValueError, match="out must have shape"):
        ops.rms_norm(x, w, 1e-6, out=poisoned((3, 64), torch.float32))
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(_randn(2, 7, dtype=torch.float32))
    with pytest.raises(ValueError, match="must have 3 dims"):
        ops.rotary_embedding(torch.zeros(4, dtype=torch.long), x, x, x)
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        ops.silu_and_mul([[1.0, 2.0]])  # type: ignore[arg-type]
    # Outside the interpreter, CPU tensors are refused with a pointer to the reference path.
    monkeypatch.setattr(_common, "is_interpreting", lambda: False)
    if DEVICE.type == "cpu":
        with pytest.raises(ValueError, match="need CUDA tensors"):
            ops.silu_and_mul(_randn(2, 8, dtype=torch.float32))
