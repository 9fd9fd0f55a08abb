"""A replica's start-up, stage by stage (replica/startup.py): what the engine records, what
the replica reports (/debug/replicas' record, the two gauges), and the recorder's rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from iterserve.dashboards import metrics as m
from iterserve.deploy.engine_info import describe_engine
from iterserve.replica.config import EngineConfig
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.models.layers import Linear
from iterserve.replica.startup import STAGES, StartupRecorder, populate_page_cache

TINY = {"model": "iterserve-tiny", "device": "cpu", "max_model_len": 256,
        "num_gpu_blocks_override": 32}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(**TINY))


def test_the_engine_records_every_stage_it_goes_through(engine: LLMEngine) -> None:
    stages = engine.startup.as_dict()
    # STAGES order; on CPU, graphs is the compiled decode attention's build
    assert list(stages) == ["model_config", "tokenizer", "weights_read", "weights_place",
                            "weights_pack", "kv_cache", "graphs", "engine_start"]
    assert all(record["seconds"] > 0 for record in stages.values())
    params = sum(p.nbytes for p in engine.runner.model.parameters())
    # safetensors in the engine's dtype: the mapped tensors are copied once, into the
    # parameters, and nothing else is written
    assert stages["weights_place"]["bytes_copied"] == params
    # the CPU cache is allocated, not written (pages are faulted in as blocks fill)
    assert stages["kv_cache"]["bytes_copied"] == 0
    linears = sum(m.weight.nbytes for m in engine.runner.model.modules() if isinstance(m, Linear))
    assert stages["weights_pack"]["bytes_copied"] == linears  # oneDNN's copy of each linear
    assert engine.runner.startup_s.keys() == {"weights_read", "weights_place", "weights_pack",
                                              "kv_cache", "graphs"}


def test_describe_engine_carries_the_stages(engine: LLMEngine) -> None:
    class Shell:  # describe_engine reads what AsyncLLMEngine has
        def __init__(self, inner: LLMEngine) -> None:
            self.config, self.tokenizer, self.model_name = (inner.config, inner.tokenizer,
                                                            inner.model_name)
            self.startup, self.stats = inner.startup, inner.stats
            self.resident_loras = inner.resident_loras

    info = describe_engine(Shell(engine))
    assert info["startup"]["stages"] == engine.startup.as_dict()


def test_the_builtin_gguf_is_dequantised_straight_into_its_parameters() -> None:
    """The built-in GGUF (Q4_1, Q8_0, F32): nothing is written but the parameters (before,
    numpy's dense buffers and the unpermuted Q/K rows: 1129 MB for 540 MB of parameters)."""
    from iterserve.replica.gguf_loader import load_gguf_checkpoint
    from iterserve.replica.model_source import builtin_model_path
    from iterserve.replica.ops import select_ops

    copied: list[int] = []
    model, _ = load_gguf_checkpoint(builtin_model_path(), torch.float32, "cpu",
                                    select_ops("torch"), copied.append)
    assert sum(copied) == 0 and sum(p.nbytes for p in model.parameters()) > 500e6


def test_recorder_rules(tmp_path: Path) -> None:
    startup = StartupRecorder()
    with startup.stage("kv_cache") as stage:
        stage.copied(10)
    with startup.stage("imports"):
        pass
    with startup.stage("kv_cache") as stage:  # a stage entered twice adds up
        stage.copied(5)
    other = StartupRecorder()
    other.record("imports").seconds = 1.0
    startup.merge(other)
    record = startup.as_dict()
    assert list(record) == ["imports", "kv_cache"]  # STAGES order, not entry order
    assert record["kv_cache"]["bytes_copied"] == 15 and record["imports"]["seconds"] >= 1.0
    with pytest.raises(ValueError, match="unknown start-up stage"):
        startup.record("warp_drive")
    assert STAGES[0] == "actor_start" and STAGES[-1] == "first_token"
    file = tmp_path / "w.bin"
    file.write_bytes(b"x" * 10000)
    (tmp_path / "empty.bin").write_bytes(b"")
    assert populate_page_cache([file, tmp_path / "empty.bin"]) == 10000


def test_the_stat_logger_exposes_seconds_and_bytes_per_stage(engine: LLMEngine) -> None:
    registry = CollectorRegistry()
    logger = m.PrometheusStatLogger("tiny", "r0", registry=registry)
    logger.record_startup(engine.startup.as_dict())
    for stage, record in engine.startup.as_dict().items():
        labels = {"model_name": "tiny", "replica": "r0", "stage": stage}
        assert registry.get_sample_value(m.metric_name(m.REPLICA_STARTUP_SECONDS),
                                         labels) == pytest.approx(record["seconds"])
        assert registry.get_sample_value(m.metric_name(m.REPLICA_STARTUP_BYTES_COPIED),
                                         labels) == record["bytes_copied"]
