"""The dashboard's PromQL as the tests run it: every target, Grafana's variables filled in.

tests/unit/test_dashboard.py checks the queries' names against the metrics; the Prometheus
integration test runs each one against a live Prometheus scraping a live server.
"""

from __future__ import annotations

from iterserve.dashboards.panels import ROWS, Panel, Target


def all_targets() -> list[tuple[Panel, Target]]:
    return [(panel, target) for row in ROWS for panel in row.panels for target in panel.targets]


def render_query(expr: str, model_name: str = ".*", rate_interval: str = "1m") -> str:
    """Substitute Grafana's variables, to run a panel query against Prometheus directly."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model_name", model_name)
