"""Metrics that tell the truth (issue 14 part 1), at the engine: the idle stats tick, every
ended request counted once under its reason, and vLLM's exact names under ``vllm:``."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from iterserve.dashboards import metrics as m
from iterserve.deploy.engine_info import describe_engine
from iterserve.loadtests.studies.reliability.metrics_truth import disagreements, engine_view, metrics_view
from iterserve.replica import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.async_engine import IDLE_WAIT_S
from iterserve.replica.stats import FINISH_REASONS

SIM = {"runner": "simulated", "max_model_len": 256, "num_gpu_blocks_override": 64,
       "max_num_seqs": 8}


def _exposition(registry: CollectorRegistry) -> str:
    import prometheus_client

    return prometheus_client.generate_latest(registry).decode()


def test_finish_reasons_are_one_list() -> None:
    assert m.FINISH_REASONS == FINISH_REASONS


def test_aborts_are_counted_once_under_abort() -> None:
    registry = CollectorRegistry()
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM))
    engine.add_stat_logger(m.PrometheusStatLogger("sim", "r0", registry=registry))
    for i in range(3):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=50), f"a{i}")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), "short")
    engine.step()
    engine.abort_request("a0")
    engine.abort_request("a0")  # twice: still one abort
    while engine.has_unfinished_requests() and len(engine.children) > 2:
        engine.step()
    engine.end_all_requests("abort")  # a shutdown ends the rest
    engine.log_idle_stats()
    assert engine.finished_by_reason == {"stop": 0, "length": 1, "abort": 3, "error": 0}
    value = registry.get_sample_value
    labels = {"model_name": "sim", "replica": "r0"}
    for reason, count in engine.finished_by_reason.items():
        assert value("iterserve:request_success_total",
                     {**labels, "finished_reason": reason}) == count
    assert value("iterserve:num_requests_running", labels) == 0
    assert value("iterserve:kv_cache_usage_perc", labels) == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_idle_tick_refreshes_gauges_after_disconnects() -> None:
    """The fault of issue 14: running/KV gauges froze at the last step once streams left."""
    registry = CollectorRegistry()

    async def scenario() -> tuple[str, dict]:
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(**SIM))
        engine.add_stat_logger(m.PrometheusStatLogger("sim", "r1", registry=registry))
        try:
            async def read_two(i: int) -> None:
                stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=200), f"s{i}")
                async for out in stream:
                    if out.num_output_tokens >= 2:
                        break
                await stream.aclose()  # the client hangs up

            await asyncio.gather(*(read_two(i) for i in range(6)))
            await asyncio.sleep(2 * IDLE_WAIT_S + 0.1)
            info = describe_engine(engine, {"replica_id": "r1"})
            return _exposition(registry), info
        finally:
            engine.shutdown()

    text, info = asyncio.run(scenario())
    views = metrics_view(text)
    assert not disagreements(views, engine_view([info])), (views, info)
    assert views["r1"].running == 0 and views["r1"].kv_usage == 0
    assert views["r1"].finished == {"stop": 0, "length": 0, "abort": 6, "error": 0}


def test_shutdown_ends_open_streams_with_an_error_and_counts_them() -> None:
    registry = CollectorRegistry()

    async def scenario() -> tuple[BaseException | None, dict]:
        engine = AsyncLLMEngine(EngineConfig.from_kwargs(**SIM))
        engine.add_stat_logger(m.PrometheusStatLogger("sim", "r2", registry=registry))
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=200), "long")
        await stream.__anext__()
        engine.shutdown()
        error = None
        started = time.monotonic()
        try:
            async for _ in stream:
                assert time.monotonic() - started < 10
        except Exception as caught:  # noqa: BLE001 - the test inspects it
            error = caught
        return error, engine.stats().finished_by_reason

    error, finished = asyncio.run(scenario())
    assert error is not None and "shut down" in str(error)
    assert finished["abort"] == 1


def test_vllm_prefix_gives_vllms_names_and_labels() -> None:
    registry = CollectorRegistry()
    logger = m.PrometheusStatLogger("tiny", "r0", registry=registry, prefix=m.VLLM_PREFIX)
    from test_metrics import _engine, _finished, _iteration

    logger.record(_engine(num_out_of_blocks=1), _iteration(), [_finished("abort")])
    names = {f.name: f for f in text_string_to_metric_families(_exposition(registry))}
    vllm_labels = {"model_name": "tiny", "engine": "0", "replica": "r0"}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:iteration_tokens_total",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens"):
        assert name in names, name
        assert set(names[name].samples[0].labels) >= set(vllm_labels), name
    assert registry.get_sample_value("vllm:num_requests_waiting", vllm_labels) == 2
    assert registry.get_sample_value(
        "vllm:request_success_total", {**vllm_labels, "finished_reason": "abort"}) == 1
    # iterserve's own metric keeps iterserve's name (no invented vllm: name).
    assert registry.get_sample_value(
        "iterserve:num_out_of_blocks_total", {"model_name": "tiny", "replica": "r0"}) == 1
    assert not any(n.startswith("vllm:num_out_of_blocks") for n in names)


def test_dashboard_queries_follow_the_prefix() -> None:
    from iterserve.dashboards.grafana import build_dashboard

    expr = "histogram_quantile(0.5, rate(iterserve:iteration_tokens_bucket[1m])) " \
           "+ iterserve:num_out_of_blocks_total + iterserve:num_requests_running"
    assert m.translate_query(expr, m.VLLM_PREFIX) == (
        "histogram_quantile(0.5, rate(vllm:iteration_tokens_total_bucket[1m])) "
        "+ iterserve:num_out_of_blocks_total + vllm:num_requests_running")
    text = str(build_dashboard(m.VLLM_PREFIX))
    assert "vllm:kv_cache_usage_perc" in text and "iterserve:kv_cache_usage_perc" not in text


def test_a_failed_request_is_counted_once_under_error(monkeypatch: object) -> None:
    registry = CollectorRegistry()
    engine = LLMEngine(EngineConfig.from_kwargs(**SIM))
    engine.add_stat_logger(m.PrometheusStatLogger("sim", "r3", registry=registry))
    detokenize = engine._detokenize

    def faulty(request: object, runner_output: object) -> object:
        if request.request_id == "bad":  # type: ignore[attr-defined]
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return detokenize(request, runner_output)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_detokenize", faulty)  # type: ignore[attr-defined]
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), "bad")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), "good")
    while engine.has_unfinished_requests():
        engine.step()
    engine.abort_request("bad")  # the client leaves after the error: not counted again
    engine.log_idle_stats()
    assert engine.finished_by_reason == {"stop": 0, "length": 1, "abort": 0, "error": 1}
    assert registry.get_sample_value("iterserve:request_success_total", {
        "model_name": "sim", "replica": "r3", "finished_reason": "error"}) == 1


def test_metrics_prefix_flag_reaches_the_app_args() -> None:
    import pytest

    from iterserve.deploy.app import AppArgs
    from iterserve.deploy.cli_serve import app_args_from, build_parser

    args = build_parser().parse_args(["--metrics-prefix", "vllm:"])
    assert AppArgs.model_validate(app_args_from(args)).metrics_prefix == "vllm:"
    assert AppArgs().metrics_prefix == m.DEFAULT_PREFIX
    with pytest.raises(ValueError, match="metrics_prefix"):
        AppArgs(metrics_prefix="sglang:")
