"""The engine's CPU linears through oneDNN: the setting, the packed weights and the fallback."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from iterserve.replica import LLM, cpu_linear
from iterserve.replica.config import EngineConfig
from iterserve.replica.models.layers import Linear
from iterserve.replica.resolve import resolve_engine_config


def tiny(**kwargs: object) -> LLM:
    return LLM("iterserve-tiny", max_model_len=512, num_gpu_blocks_override=256, **kwargs)


def test_cpu_linear_resolves_to_onednn_on_cpu_and_torch_on_cuda() -> None:
    on_cpu = resolve_engine_config(EngineConfig(model="iterserve-tiny"), cuda_available=False)
    assert on_cpu.cpu_linear == "onednn"
    on_cuda = resolve_engine_config(EngineConfig(model="iterserve-tiny"), cuda_available=True)
    assert on_cuda.cpu_linear == "torch"
    chosen = EngineConfig.from_kwargs(model="iterserve-tiny", cpu_linear="torch")
    assert resolve_engine_config(chosen, cuda_available=False).cpu_linear == "torch"
    with pytest.raises(ValueError, match="cpu_linear"):
        EngineConfig.from_kwargs(cpu_linear="mkl")


def test_onednn_linears_match_f_linear_on_the_tiny_model() -> None:
    model = tiny().engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    gen = torch.Generator().manual_seed(1)
    for module in linears:
        x = torch.randn((5, module.weight.shape[1]), generator=gen)  # [5, in]
        torch.testing.assert_close(module(x), F.linear(x, module.weight, module.bias),
                                   atol=1e-5, rtol=1e-5)


def test_a_packed_linear_that_differs_falls_back_to_f_linear_loudly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = cpu_linear.pack_weight
    monkeypatch.setattr(cpu_linear, "pack_weight", lambda weight: real(weight * 1.01))
    with caplog.at_level(logging.WARNING, logger="iterserve.replica.cpu_linear"):
        runner = tiny().engine.runner
    assert runner.cpu_paths["linear"].startswith("torch (fallback: ")
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, Linear))
    assert any("fall back to F.linear" in r.getMessage() for r in caplog.records)


def test_torch_linears_pack_nothing() -> None:
    runner = tiny(cpu_linear="torch").engine.runner
    assert runner.cpu_paths == {"linear": "torch"}
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, Linear))
