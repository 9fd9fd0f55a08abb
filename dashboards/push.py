"""`iterserve dashboards push`: upload the folder, datasource and dashboard to Grafana.

    iterserve dashboards push --url http://127.0.0.1:3000 --api-key "$GRAFANA_TOKEN" \
        --prometheus-url http://127.0.0.1:9090

Idempotent: the folder and datasource are created when missing and updated when present
(matched by uid), and the dashboard is posted with ``overwrite`` under its fixed uid, so a
second push changes nothing but the dashboard's version. Uses grafana-client (HTTP API).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from dataclasses import dataclass
from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError

from iterserve.dashboards import grafana, provisioning

API_KEY_ENV = "GRAFANA_API_KEY"
NOT_FOUND = 404


@dataclass(frozen=True)
class PushResult:
    folder_created: bool
    datasource_created: bool
    dashboard_url: str


def _exists(fetch: Any, uid: str) -> bool:
    try:
        fetch(uid)
    except GrafanaClientError as error:
        if error.status_code == NOT_FOUND:
            return False
        raise
    return True


def _dashboard_for(datasource_uid: str) -> dict[str, Any]:
    """The generated dashboard with its datasource variable preset to the pushed datasource."""
    dashboard = copy.deepcopy(grafana.build_dashboard())
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "datasource":
            variable["current"] = {"text": provisioning.DATASOURCE_NAME, "value": datasource_uid}
    dashboard["id"] = None
    return dashboard


def push(api: GrafanaApi, prometheus_url: str = provisioning.DEFAULT_PROMETHEUS_URL,
         message: str = "iterserve dashboards push") -> PushResult:
    folder_uid = provisioning.FOLDER_UID
    folder_created = not _exists(api.folder.get_folder, folder_uid)
    if folder_created:
        api.folder.create_folder(provisioning.FOLDER_TITLE, uid=folder_uid)

    source = provisioning.datasource(prometheus_url)
    datasource_created = not _exists(api.datasource.get_datasource_by_uid, source["uid"])
    if datasource_created:
        api.datasource.create_datasource(source)
    else:
        api.datasource.update_datasource_by_uid(source["uid"], source)

    response = api.dashboard.update_dashboard({
        "dashboard": _dashboard_for(source["uid"]),
        "folderUid": folder_uid,
        "overwrite": True,
        "message": message,
    })
    return PushResult(folder_created, datasource_created, str(response.get("url", "")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="iterserve dashboards push", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="Grafana base URL")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"service-account token (default: ${API_KEY_ENV})")
    parser.add_argument("--prometheus-url", default=provisioning.DEFAULT_PROMETHEUS_URL,
                        help="URL Grafana uses to reach Prometheus")
    parser.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout, seconds")
    args = parser.parse_args(argv)
    if not args.api_key:
        parser.error(f"--api-key or ${API_KEY_ENV} is required")
    api = GrafanaApi.from_url(args.url, credential=args.api_key, timeout=args.timeout)
    result = push(api, args.prometheus_url)
    print(f"folder {'created' if result.folder_created else 'exists'}; "
          f"datasource {'created' if result.datasource_created else 'updated'}; "
          f"dashboard {result.dashboard_url or grafana.DASHBOARD_UID}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
