"""`iterserve dashboards push` against a local stand-in for Grafana's HTTP API.

Why a stand-in: no Grafana server can be installed here (Debian ships none, and PyPI/npm only
have clients), so this runs grafana-client's real HTTP stack against a small stdlib server
that implements the five endpoints push uses and keeps state like Grafana does. Grafana's own
schema validation of the dashboard is not covered.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from grafana_client.client import GrafanaUnauthorizedError

from iterserve.dashboards import grafana, provisioning, push

TOKEN = "glsa_test_token"


class FakeGrafana:
    def __init__(self) -> None:
        self.folders: dict[str, dict[str, Any]] = {}
        self.datasources: dict[str, dict[str, Any]] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.unauthorized = 0


def _handler(state: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            return

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length", 0))
            return json.loads(self.rfile.read(length) or b"{}")

        def _route(self, method: str) -> None:
            state.calls.append((method, self.path))
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                state.unauthorized += 1
                return self._reply(401, {"message": "Unauthorized"})
            parts = self.path.split("?")[0].strip("/").split("/")
            if parts[:2] == ["api", "folders"]:
                return self._folders(method, parts[2:])
            if parts[:2] == ["api", "datasources"]:
                return self._datasources(method, parts[2:])
            if parts == ["api", "dashboards", "db"] and method == "POST":
                return self._dashboard(self._body())
            return self._reply(404, {"message": "Not found"})

        def _folders(self, method: str, rest: list[str]) -> None:
            if method == "GET" and rest:
                folder = state.folders.get(rest[0])
                return self._reply(200, folder) if folder else self._reply(
                    404, {"message": "folder not found"})
            body = self._body()
            if body["uid"] in state.folders:
                return self._reply(409, {"message": "a folder with that uid already exists"})
            state.folders[body["uid"]] = body
            return self._reply(200, body)

        def _datasources(self, method: str, rest: list[str]) -> None:
            if method == "GET":
                source = state.datasources.get(rest[-1])
                return self._reply(200, source) if source else self._reply(
                    404, {"message": "Data source not found"})
            body = self._body()
            if method == "POST" and body["uid"] in state.datasources:
                return self._reply(409, {"message": "data source with the same uid exists"})
            state.datasources[body["uid"]] = body
            return self._reply(200, {"datasource": body, "message": "ok"})

        def _dashboard(self, body: dict[str, Any]) -> None:
            dashboard = body["dashboard"]
            if body["folderUid"] not in state.folders:
                return self._reply(400, {"message": "folder not found"})
            previous = state.dashboards.get(dashboard["uid"])
            if previous and not body.get("overwrite"):
                return self._reply(412, {"message": "version-mismatch"})
            version = previous["version"] + 1 if previous else 1
            state.dashboards[dashboard["uid"]] = {**body, "version": version}
            return self._reply(200, {"status": "success", "uid": dashboard["uid"],
                                     "version": version, "url": f"/d/{dashboard['uid']}/x"})

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_PUT(self) -> None:
            self._route("PUT")

    return Handler


@pytest.fixture()
def fake_grafana() -> Iterator[tuple[FakeGrafana, str]]:
    state = FakeGrafana()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_push_creates_then_updates_idempotently(fake_grafana: tuple[FakeGrafana, str]) -> None:
    state, url = fake_grafana
    args = ["--url", url, "--api-key", TOKEN, "--prometheus-url", "http://prom:9090"]
    assert push.main(args) == 0
    assert push.main(args) == 0

    assert list(state.folders) == [provisioning.FOLDER_UID]
    assert state.datasources[provisioning.DATASOURCE_UID]["url"] == "http://prom:9090"
    stored = state.dashboards[grafana.DASHBOARD_UID]
    assert stored["version"] == 2 and stored["overwrite"] is True
    assert stored["folderUid"] == provisioning.FOLDER_UID
    assert stored["dashboard"]["panels"] == grafana.build_dashboard()["panels"]
    datasource_variable = stored["dashboard"]["templating"]["list"][0]
    assert datasource_variable["current"]["value"] == provisioning.DATASOURCE_UID
    # The second push found the folder and the datasource instead of creating them again.
    assert ("POST", "/api/folders") in state.calls
    assert state.calls.count(("POST", "/api/folders")) == 1
    assert state.calls.count(("POST", "/api/datasources")) == 1
    assert ("PUT", f"/api/datasources/uid/{provisioning.DATASOURCE_UID}") in state.calls
    assert state.unauthorized == 0


def test_push_reports_a_bad_token(fake_grafana: tuple[FakeGrafana, str]) -> None:
    state, url = fake_grafana
    with pytest.raises(GrafanaUnauthorizedError):
        push.main(["--url", url, "--api-key", "wrong"])
    assert state.unauthorized == 1
    assert state.dashboards == {}


def test_push_requires_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(push.API_KEY_ENV, raising=False)
    with pytest.raises(SystemExit):
        push.main(["--url", "http://127.0.0.1:1"])
