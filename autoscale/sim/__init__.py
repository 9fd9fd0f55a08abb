"""The cluster simulator and what it is measured with (iterserve.autoscale.sim).

Evidence, not production: no module outside this package, `loadtests/` and the tests
imports it. It sits above the router and autoscaler it drives (`KVRouterCore`, `decide`)
and the engine's own scheduler and block manager, which it runs unchanged on a simulated
GPU; the README's "Cluster simulator and capacity planning" section describes it.

- `cluster.py` (`simulate`), `simulated_replica.py`, `state.py`, `decodes.py`, `prefix.py`,
  `itl.py`, `block_manager.py`: the simulator; `config.py` and `results.py`: what it takes
  and gives back.
- `routing_context.py`: the contract its routing and autoscaling policies implement;
  `iterserve_router.py` and `policies.py`: iterserve's own under it;
  `baseline_routers.py`, `baseline_cache_routers.py`, `prefix_history.py`,
  `baseline_autoscalers.py`: the published ones it is compared with.
- The one workload model: `workload.py` (the request type and the benchmark's length
  buckets), `arrivals.py` (arrival processes), `shapes.py` (the named cluster workloads),
  `traces.py` (recorded traces); the benchmarks, Locust and the Ray experiments use them.
- `planner.py`: the capacity search behind `iterserve plan`.
"""
