"""The engine's CPU paths: oneDNN linears, SDPA prefill, compiled block decode attention and
compiled elementwise ops, their settings and fallbacks, and the CPU KV cache sized from free memory.

The attention kernels themselves are checked against kernels/reference.py in
tests/kernels/test_cpu_attention.py; here the engine runs them.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from iterserve.deploy.settings import AppArgs
from iterserve.replica import LLM, SamplingParams, cpu_linear, cpu_memory
from iterserve.replica.config import CacheConfig, EngineConfig
from iterserve.replica.models.layers import Linear
from iterserve.replica.resolve import resolve_engine_config

ALL_LOOPS = dict(cpu_linear="torch", cpu_prefill_attention="loop", cpu_decode_attention="loop",
                 cpu_elementwise="eager")
FAST = {"linear": "onednn", "prefill_attention": "sdpa", "decode_attention": "blocks",
        "elementwise": "compiled"}


def tiny(**kwargs: object) -> LLM:
    return LLM("iterserve-tiny", max_model_len=512, num_gpu_blocks_override=256, **kwargs)


def test_cpu_paths_resolve_fast_on_cpu_and_unused_on_cuda() -> None:
    on_cpu = resolve_engine_config(EngineConfig(model="iterserve-tiny"), cuda_available=False)
    assert (on_cpu.cpu_linear, on_cpu.cpu_prefill_attention, on_cpu.cpu_decode_attention,
            on_cpu.cpu_elementwise) == ("onednn", "sdpa", "blocks", "compiled")
    on_cuda = resolve_engine_config(EngineConfig(model="iterserve-tiny"), cuda_available=True)
    assert (on_cuda.cpu_linear, on_cuda.cpu_prefill_attention, on_cuda.cpu_decode_attention,
            on_cuda.cpu_elementwise) == ("torch", "loop", "loop", "eager")
    chosen = EngineConfig.from_kwargs(model="iterserve-tiny", **ALL_LOOPS)
    assert resolve_engine_config(chosen, cuda_available=False).cpu_linear == "torch"
    with pytest.raises(ValueError, match="cpu_decode_attention"):
        EngineConfig.from_kwargs(cpu_decode_attention="padded")
    with pytest.raises(ValueError, match="cpu_elementwise"):
        EngineConfig.from_kwargs(cpu_elementwise="fused")


def test_decode_attention_runs_compiled_on_this_machine() -> None:
    """Fails (never skips) when the block decode falls back to the loop here: a missing C++
    compiler or an inductor regression would otherwise cost 2-5x silently."""
    llm = tiny()
    assert llm.engine.runner.cpu_paths == FAST
    assert llm.engine.runner.cpu_attention.compile_seconds > 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for prompts in (["a b c"], ["a b c", "d e f g h", "i"]):  # one decode, then several
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    assert llm.engine.runner.cpu_paths == FAST  # nothing fell back while decoding
    # The start-up warm-up called the decode as the steps do (strides, scale, inference
    # mode): serving compiles nothing more.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_fast_paths_keep_greedy_tokens_through_prefix_hits_chunks_and_preemption() -> None:
    """The fast paths against the reference loops and F.linear on one workload: shared
    prefixes (cache hits), prompts longer than the step budget (chunks after a cached part),
    and few KV blocks, so requests preempt and recompute."""
    shared = " ".join(f"w{i}" for i in range(40))
    prompts = [shared + f" tail {i} " + "x " * (i * 7) for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = {}
    for name, kwargs in (("fast", {}), ("loops", ALL_LOOPS)):
        llm = LLM("iterserve-tiny", max_model_len=512, num_gpu_blocks_override=24,
                  max_num_batched_tokens=64, max_num_seqs=8, **kwargs)
        outputs[name] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        stats = llm.engine.scheduler
        assert stats.num_preemptions > 0, name  # the workload did preempt
    assert outputs["fast"] == outputs["loops"]


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
    runner = tiny(**ALL_LOOPS).engine.runner
    assert runner.cpu_paths == {"linear": "torch", "prefill_attention": "loop",
                                "decode_attention": "loop", "elementwise": "eager"}
    assert all(m.packed is None for m in runner.model.modules() if isinstance(m, Linear))


def test_cpu_kv_budget_shares_free_memory_and_stops_at_what_requests_can_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_memory, "available_memory_bytes", lambda: 10 * 2**30)
    block = 2**20  # bytes per block
    # 0.5 of 10 GiB, shared by two engines: 2.5 GiB, below 256 requests x 64 blocks x 1 MiB
    shared = CacheConfig(gpu_memory_utilization=0.5, cpu_replicas_per_node=2)
    assert cpu_memory.cpu_kv_cache_bytes(shared, block, 256, 1024) == int(2.5 * 2**30)
    # 4 requests of 1024 tokens (64 blocks of 16) use at most 256 MiB
    assert cpu_memory.cpu_kv_cache_bytes(shared, block, 4, 1024) == 4 * 64 * block
    given = CacheConfig(cpu_kv_cache_bytes=123 * block)  # the user's budget wins
    assert cpu_memory.cpu_kv_cache_bytes(given, block, 256, 1024) == 123 * block


def test_available_memory_is_read_from_the_system() -> None:
    assert 0 < cpu_memory.available_memory_bytes() < 2**50


def test_the_serve_app_divides_cpu_memory_among_replicas_that_may_share_a_node() -> None:
    assert AppArgs.model_validate({}).engine_config().cache.cpu_replicas_per_node == 1
    assert AppArgs.model_validate({"num_replicas": 3}).engine_config() \
        .cache.cpu_replicas_per_node == 3
    autoscaled = AppArgs.model_validate({"num_replicas": "auto", "max_replicas": 6,
                                         "max_replicas_per_node": 2})
    assert autoscaled.engine_config().cache.cpu_replicas_per_node == 2
    given = AppArgs.model_validate({"num_replicas": 3, "cpu_replicas_per_node": "1"})
    assert given.engine_config().cache.cpu_replicas_per_node == 1
