"""The import path the README documented before the simulator moved into `autoscale/sim/`
(`iterserve.autoscale.cluster_sim.simulate`); it lives in `sim/cluster.py`.
tests/unit/test_import_paths.py imports both."""

from iterserve.autoscale.sim.cluster import simulate

__all__ = ["simulate"]
