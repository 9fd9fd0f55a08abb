"""The tournament's LoRA adapter cells (router_tournament/lora_adapters.py): a small cell of
each contestant runs, counts its adapter loads and the replicas serving the hottest adapter,
and the table states the issue's measure; the "reversed" variant turns the coldest adapter
into the hottest at half time."""

from __future__ import annotations

from collections import Counter

from iterserve.autoscale.sim.lora_workload import with_zipf_adapters
from iterserve.autoscale.sim.shapes import make
from iterserve.loadtests.studies.router_tournament.lora_adapters import (
    LORA_ROUTERS,
    lora_cells,
    run_lora_cell,
    table,
)

ADAPTERS = {"num_adapters": 20, "zipf_a": 1.0, "base_fraction": 0.1, "max_loras": 2,
            "max_cpu_loras": 4}


def test_the_reversed_variant_makes_the_coldest_adapter_the_hottest_from_then_on() -> None:
    requests = with_zipf_adapters(make("steady", 100.0, 20.0, seed=0), num_adapters=20,
                                  reversed_from_s=10.0)
    before = Counter(r.adapter for r in requests if r.arrival_time < 10.0)
    after = Counter(r.adapter for r in requests if r.arrival_time >= 10.0)
    assert before.most_common(1)[0][0] == "lora-1" and after.most_common(1)[0][0] == "lora-20"


def test_each_contestant_runs_a_small_cell_and_the_table_states_the_measure() -> None:
    cells = lora_cells([2], [0.5], [0], ["reversed"], list(LORA_ROUTERS), capacity=10.0,
                       adapters=ADAPTERS)
    results = []
    for cell in cells:
        cell["duration_s"] = 6.0  # small: the figures are not the point here
        results.append(run_lora_cell(cell))
    for result in results:
        assert result["finished"] == result["requests"] > 0
        assert result["adapter_loads"]["from_disk"] >= 1
        assert 1 <= result["hot_adapter_replicas"] <= 2 and result["hot_adapter"] == "lora-20"
    text = table(results)
    assert "| reversed | 2 | 0.5 | 0 | iterserve |" in text
    assert "iterserve p99 <= ray-multiplex p99" in text
