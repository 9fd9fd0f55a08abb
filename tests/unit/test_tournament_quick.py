"""The tournament's --quick variant end to end (8 replicas, 60 virtual s, skewed bursts).

Three routers keep it well under a minute on a shared 2-core box; the full --quick run
(every router) is the same code path with more cells.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from iterserve.loadtests.studies.router_tournament.tournament import main


def test_quick_tournament_writes_tables_json_and_plots(tmp_path: Path) -> None:
    assert main(["--quick", "--jobs", "1", "--out", str(tmp_path),
                 "--routers", "pow2", "iterserve", "dynamo"]) == 0
    store = json.loads((tmp_path / "tournament_quick.json").read_text())
    cells = list(store["cells"].values())
    assert sorted(c["router"] for c in cells) == ["dynamo", "iterserve", "pow2"]
    for c in cells:
        assert c["finished"] == c["requests"] > 500
        p99, lo, hi = c["ttft_p99_s"]
        assert math.isfinite(p99) and lo <= p99 <= hi
        assert c["goodput_rps"][0] > 0
    report = (tmp_path / "tournament_quick.md").read_text()
    assert "| iterserve" in report and "p99 tie group" in report
