"""Grafana dashboard generated from `panels.py`, plus every generated config file.

    python -m iterserve.dashboards.grafana            # rewrite the generated files
    python -m iterserve.dashboards.grafana --check    # exit 1 if any file is stale

Generated files (a unit test fails on drift): ``iterserve.json`` (the dashboard),
``provisioning/`` (Grafana datasource + dashboard provider) and the two Prometheus configs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from iterserve.dashboards import metrics, provisioning
from iterserve.dashboards.panels import ROWS, Panel, Row

DASHBOARD_UID = "iterserve-overview"
DASHBOARD_TITLE = "iterserve: LLM serving"
DASHBOARD_FILE = "iterserve.json"
DATASOURCE_VARIABLE = "DS_PROMETHEUS"
GRID_WIDTH = 24
PACKAGE_DIR = Path(__file__).resolve().parent

_DATASOURCE_REF = {"type": "prometheus", "uid": f"${{{DATASOURCE_VARIABLE}}}"}
_REF_IDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _field_config(panel: Panel) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "never",
        "spanNulls": True,
        "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
        "thresholdsStyle": {"mode": "dashed" if panel.threshold_line is not None else "off"},
    }
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if panel.threshold_line is not None:
        steps.append({"color": "red", "value": panel.threshold_line})
    defaults: dict[str, Any] = {
        "unit": panel.unit,
        "min": 0,
        "custom": custom,
        "thresholds": {"mode": "absolute", "steps": steps},
        "color": {"mode": "palette-classic"},
    }
    if panel.max_value is not None:
        defaults["max"] = panel.max_value
    return {"defaults": defaults, "overrides": []}


def _panel_json(panel: Panel, panel_id: int, x: int, y: int, prefix: str) -> dict[str, Any]:
    targets = [
        {"refId": _REF_IDS[index], "expr": metrics.translate_query(target.expr, prefix),
         "legendFormat": target.legend,
         "range": True, "datasource": _DATASOURCE_REF}
        for index, target in enumerate(panel.targets)
    ]
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": _DATASOURCE_REF,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": _field_config(panel),
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                       "calcs": ["mean", "max", "lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def _layout(rows: tuple[Row, ...], prefix: str) -> list[dict[str, Any]]:
    """Rows of panels packed left to right on Grafana's 24-column grid."""
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in rows:
        panels.append({"id": next_id, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            panels.append(_panel_json(panel, next_id, x, y, prefix))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return panels


def _templating(prefix: str) -> dict[str, Any]:
    running = metrics.metric_name(metrics.NUM_REQUESTS_RUNNING, prefix=prefix)
    model_query = f"label_values({running}, model_name)"
    return {"list": [
        {"name": DATASOURCE_VARIABLE, "label": "Datasource", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
        {"name": "model_name", "label": "Model", "type": "query", "datasource": _DATASOURCE_REF,
         "query": {"query": model_query, "refId": "model_name"}, "definition": model_query,
         "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0},
    ]}


def build_dashboard(prefix: str = metrics.DEFAULT_PREFIX) -> dict[str, Any]:
    """The Grafana dashboard model (schemaVersion 39), ready for provisioning or the API;
    `prefix`: the replicas' --metrics-prefix (the queries use those names)."""
    return {
        "uid": DASHBOARD_UID,
        "title": DASHBOARD_TITLE,
        "description": "iterserve replicas: latency, throughput, scheduler, KV cache, fleet.",
        "tags": ["iterserve", "llm", "serving"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": []},
        "templating": _templating(prefix),
        "panels": _layout(ROWS, prefix),
    }


def dashboard_json(prefix: str = metrics.DEFAULT_PREFIX) -> str:
    return json.dumps(build_dashboard(prefix), indent=2, sort_keys=True) + "\n"


def generated_files(prefix: str = metrics.DEFAULT_PREFIX) -> dict[Path, str]:
    """Every generated file (path relative to dashboards/) and its expected content."""
    files = {Path(DASHBOARD_FILE): dashboard_json(prefix)}
    files.update(provisioning.generated_files())
    return files


def write_generated(root: Path = PACKAGE_DIR,
                    prefix: str = metrics.DEFAULT_PREFIX) -> list[Path]:
    written = []
    for relative, content in generated_files(prefix).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written


def stale_files(root: Path = PACKAGE_DIR) -> list[Path]:
    return [relative for relative, content in generated_files().items()
            if not (root / relative).is_file() or (root / relative).read_text() != content]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="iterserve dashboards generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if a generated file is stale")
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR, help="folder to write into")
    parser.add_argument("--metrics-prefix", choices=metrics.PREFIXES, default=metrics.DEFAULT_PREFIX,
                        help="the replicas' --metrics-prefix; the dashboard queries those names")
    args = parser.parse_args(argv)
    if args.metrics_prefix != metrics.DEFAULT_PREFIX and args.out == PACKAGE_DIR:
        parser.error("--metrics-prefix other than the default needs --out (the files in the "
                     "package are generated for the default names)")
    if args.check:
        stale = stale_files(args.out)
        for path in stale:
            print(f"stale: {path} (run python -m iterserve.dashboards.grafana)", file=sys.stderr)
        return 1 if stale else 0
    for path in write_generated(args.out, args.metrics_prefix):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
