"""The production policies under the names the cluster simulator's users import.

One class each, shared with the tournament and (through `KVRouterCore` / `decide`) with
the Ray adapters: `IterserveRouter` is `iterserve_router.IterserveRouter` (its in-flight
corrections from its own tracker by default, or from the simulator's
`ReplicaView.correction` with `in_flight=CALLER_VIEWS`); `IterserveAutoscaler` and
`FixedReplicas` are `baseline_autoscalers`' (the policy state threaded between ticks as
Serve's controller threads `policy_state`).
"""

from __future__ import annotations

from iterserve.autoscale.sim.baseline_autoscalers import FixedReplicas, IterserveAutoscaler
from iterserve.autoscale.sim.iterserve_router import CALLER_VIEWS, OWN_TRACKER, IterserveRouter

__all__ = ["CALLER_VIEWS", "OWN_TRACKER", "FixedReplicas", "IterserveAutoscaler",
           "IterserveRouter"]
