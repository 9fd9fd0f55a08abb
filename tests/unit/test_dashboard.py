"""The generated dashboard and configs: no drift, sound structure, only known metric names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import dashboard_queries
import yaml

from iterserve.dashboards import grafana, metrics, panels, provisioning

DASHBOARDS_DIR = Path(grafana.__file__).resolve().parent
_NAME = re.compile(re.escape(metrics.METRIC_PREFIX) + r"[a-z0-9_]+")


def test_generated_files_match_the_code() -> None:
    assert grafana.stale_files() == [], "run: python -m iterserve.dashboards.grafana"


def test_panels_are_laid_out_on_the_grid_with_unique_ids_and_units() -> None:
    dashboard = json.loads((DASHBOARDS_DIR / grafana.DASHBOARD_FILE).read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= grafana.GRID_WIDTH
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                 for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] != "row":
            assert panel["fieldConfig"]["defaults"]["unit"]
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert [t["refId"] for t in panel["targets"]] == list("ABCDEFG"[:len(panel["targets"])])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"DS_PROMETHEUS", "model_name"}


def test_every_query_uses_only_catalogued_metrics() -> None:
    exposed = set()
    for spec in metrics.ALL_METRICS:
        base = metrics.metric_name(spec)
        exposed.add(base)
        if spec.kind == "histogram":
            exposed |= {base + "_bucket", base + "_sum", base + "_count"}
    for panel, target in dashboard_queries.all_targets():
        names = set(_NAME.findall(target.expr))
        if target.requires == "gpu":
            assert not names
            continue
        assert names and names <= exposed, f"{panel.title}: {names - exposed}"
        assert 'model_name=~"$model_name"' in target.expr
        assert target.requires in panels.REQUIREMENTS


def test_the_requested_panels_exist() -> None:
    titles = " | ".join(panel.title.lower() for row in panels.ROWS for panel in row.panels)
    for word in ("first token", "inter-token", "end-to-end", "token throughput", "running",
                 "kv-cache", "preemptions", "finish reasons", "autoscaler", "router", "gpu"):
        assert word in titles
    kv_panel = next(p for row in panels.ROWS for p in row.panels if "KV" in p.title)
    assert kv_panel.threshold_line == panels.DEFAULT_KV_WATERMARK


def test_render_query_substitutes_grafana_variables() -> None:
    rendered = dashboard_queries.render_query(panels.LATENCY.panels[0].targets[0].expr, "tiny", "20s")
    assert "$" not in rendered and 'model_name=~"tiny"' in rendered and "[20s]" in rendered


def test_provisioning_files_point_at_the_dashboard_and_datasource() -> None:
    source = yaml.safe_load(
        (DASHBOARDS_DIR / "provisioning/datasources/iterserve-prometheus.yaml").read_text())
    entry = source["datasources"][0]
    assert source["apiVersion"] == 1
    assert entry["type"] == "prometheus" and entry["uid"] == provisioning.DATASOURCE_UID
    assert entry["jsonData"]["timeInterval"] == provisioning.SCRAPE_INTERVAL
    provider = yaml.safe_load(
        (DASHBOARDS_DIR / "provisioning/dashboards/iterserve.yaml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["folderUid"] == provisioning.FOLDER_UID


def test_ray_config_renames_ray_metrics_back_to_the_iterserve_prefix() -> None:
    config = yaml.safe_load((DASHBOARDS_DIR / "prometheus-ray.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["file_sd_configs"][0]["files"] == [provisioning.RAY_SERVICE_DISCOVERY_FILE]
    rule = job["metric_relabel_configs"][0]
    match = re.fullmatch(rule["regex"], "ray_iterserve_time_to_first_token_seconds_bucket")
    assert match is not None
    renamed = rule["replacement"].replace("${1}", match.group(1))
    assert renamed == metrics.metric_name(metrics.TIME_TO_FIRST_TOKEN, "_bucket")


def test_dashboards_cli_dispatches_generate_and_rejects_unknown(capsys) -> None:
    from iterserve.dashboards import cli

    assert cli.main(["generate", "--check"]) == 0
    assert cli.main(["frobnicate"]) == 2
    assert cli.main([]) == 0 and "push" in capsys.readouterr().out
