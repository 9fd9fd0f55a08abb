"""The KV-tier tournament's pieces (loadtests/studies/router_tournament/kv_tiers.py): the
unbounded cache's hit rate, and which cells run with tiers."""

from __future__ import annotations

import dataclasses

from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies.router_tournament.kv_tiers import (
    ASYNC_STORES,
    EVICTION_ARMS,
    NO_TIERS,
    SMALL_DEVICE_BLOCKS,
    TIERS,
    build_cells,
    cell_config,
    unbounded_hit_rate,
)


def test_an_unbounded_cache_serves_every_earlier_prefix_and_answer() -> None:
    first = WorkloadRequest("a", 0.0, list(range(100, 165)), 16, output_token_id=7)
    # the next turn: a's prompt (4 blocks of 16 and a token), a's answer, 15 new tokens
    turn = WorkloadRequest("b", 1.0, list(range(100, 165)) + [7] * 16 + list(range(15)), 8)
    alone = WorkloadRequest("c", 2.0, list(range(900, 933)), 8)
    total = 65 + 96 + 33
    # b's chain: blocks 0-3 (prompt), block 4 (prompt's last token + 15 of the answer)
    assert unbounded_hit_rate([turn, alone, first]) == 5 * 16 / total


def test_the_cells_run_with_tiers_but_the_no_tier_arm_and_the_async_store_what_if() -> None:
    cells = build_cells([8], 0.8, [0], None, {"multi-turn small": 10.0,
                                               "multi-tenant small": 2.0})
    assert {c["workload"] for c in cells} == {"multi-turn", "multi-tenant"}
    assert all(c["num_blocks"] == SMALL_DEVICE_BLOCKS for c in cells)
    for cell in cells:
        config = cell_config(cell)
        assert config.num_blocks == SMALL_DEVICE_BLOCKS
        if cell["router"] == ASYNC_STORES:  # the what-if: stores off the critical path
            assert config.kv_tiers == dataclasses.replace(TIERS, charge_stores=False)
        elif cell["router"] in EVICTION_ARMS:  # the host tier evicting by arc or slru
            assert config.kv_tiers == dataclasses.replace(
                TIERS, host_eviction=EVICTION_ARMS[cell["router"]])
            assert config.kv_tiers.host_eviction in ("arc", "slru")
        else:
            assert config.kv_tiers == (None if cell["router"] == NO_TIERS else TIERS)
