"""Fixtures of the reliability tests; the helpers live in reliability_support.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from reliability_support import ServeSession, free_port


@pytest.fixture(scope="session")
def serve_session() -> Iterator[ServeSession]:
    """One local Ray + Serve for every reliability module that needs it (ray marker)."""
    ray = pytest.importorskip("ray")
    from ray import serve

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024**2, namespace=f"iterserve-reliability-{port}")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield ServeSession(port)
    finally:
        serve.shutdown()
        ray.shutdown()

