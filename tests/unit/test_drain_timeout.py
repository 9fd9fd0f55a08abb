"""The replica drain covers the longest allowed generation (issue 14 part 3)."""

from __future__ import annotations

import pytest

from iterserve.deploy.app import build_app
from iterserve.deploy.llm_replica import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DRAIN_SECONDS_PER_TOKEN,
    SHUTDOWN_SLACK_S,
    drain_timeout_for,
)
from iterserve.deploy.settings import resolve_app

SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S = 20.0


def test_drain_grows_with_the_context() -> None:
    assert drain_timeout_for(128) == DEFAULT_DRAIN_TIMEOUT_S
    assert drain_timeout_for(8192) == pytest.approx(8192 * DRAIN_SECONDS_PER_TOKEN)
    assert drain_timeout_for(8192) > SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S


def test_app_derives_the_drain_unless_configured() -> None:
    assert resolve_app({"engine_kwargs": {"max_model_len": 8192, "runner": "simulated"}}
                       ).drain_timeout_s == drain_timeout_for(8192)
    assert resolve_app({"drain_timeout_s": 7}).drain_timeout_s == 7
    assert resolve_app({}).drain_timeout_s >= DEFAULT_DRAIN_TIMEOUT_S  # the model's context


def test_serve_waits_for_the_drain() -> None:
    app = build_app({"engine_kwargs": {"max_model_len": 8192, "runner": "simulated"}})
    replica = next(d for d in app._bound_deployment.init_args if hasattr(d, "_bound_deployment")
                   )._bound_deployment  # the LLMReplica the ingress is bound to
    config = replica._deployment_config
    assert config.graceful_shutdown_timeout_s == drain_timeout_for(8192) + SHUTDOWN_SLACK_S
    assert replica.init_args[1] == drain_timeout_for(8192)
