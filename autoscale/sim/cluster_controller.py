"""The Serve controller's side of the simulated cluster (`cluster.ClusterSim`'s autoscaling).

Every autoscale_interval_s the policy sees each running replica's mean (kv_usage,
num_waiting, num_running) over look_back_period_s and the requests queued at the routers
and held at the gateway or ingress queue (queued demand, as Serve counts the requests its
handles queue), and names a replica count; new replicas serve startup_delay_s later, removed ones drain. A
mixin of `ClusterSim`: it reads the cluster's slots and routers and starts and stops
replicas through it, one seam (the controller's loop) apart from the data path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iterserve.autoscale.autoscaling_policy import ReplicaSignal, ScalingContext
from iterserve.autoscale.sim.state import DRAINING, RUNNING, STARTING

if TYPE_CHECKING:
    from iterserve.autoscale.sim.cluster import ClusterSim

TICK = 0  # the controller's event kind in the cluster's event heap (its loop's period)
# The cluster's other event kinds (cluster.py; PULL_*: cluster_pulls.py)
ARRIVE, WAKE, POLL, PUSH, READY, PEER_ROUTED, PEER_COMPLETED, PULL_READ, PULL_LANDED = \
    range(TICK + 1, TICK + 10)


class ServeController:
    def _on_tick(self: ClusterSim, _: object) -> None:
        signals = {}
        for slot in self.slots:
            if slot.state == RUNNING and slot.samples:
                n = len(slot.samples)
                signals[slot.replica_id] = ReplicaSignal(
                    kv_usage=sum(s[1] for s in slot.samples) / n,
                    num_waiting=sum(s[2] for s in slot.samples) / n,
                    num_running=sum(s[3] for s in slot.samples) / n)
        ctx = ScalingContext(now=self.now, current_replicas=self._count(RUNNING),
                             target_replicas=self.target, signals=signals,
                             queued_at_handles=float(self._queued_demand()))
        desired = self.autoscaler.desired_replicas(ctx)
        if desired < 1 and ctx.queued_at_handles > 0 and not any(
                s.state in (RUNNING, STARTING) for s in self.slots):
            # Serve's controller asks for a replica before any custom policy runs: a policy
            # here must do the same (the requests would wait forever, and so would this loop)
            raise ValueError(f"autoscaler {self.autoscaler.name!r} keeps 0 replicas while "
                             f"{ctx.queued_at_handles:.0f} requests wait at the routers")
        if desired > self.target:
            for _ in range(desired - self.target):
                self._start_slot(ready_at=self.now + self.config.startup_delay_s)
            self._replicas_changed()
        elif desired < self.target:
            self._scale_down(self.target - desired)
        self.target = desired
        self._push(self.now + self.config.autoscale_interval_s, TICK, None)

    def _queued_demand(self: ClusterSim) -> int:
        """Requests waiting for a replica: at the routers, and held in front of them."""
        held = len(self.gate) if self.gate is not None else 0
        return held + sum(len(r.queue) for r in self.routers)

    def _scale_down(self: ClusterSim, count: int) -> None:
        """Cancel starting replicas first (newest first), then drain the least busy."""
        starting = [s for s in self.slots if s.state == STARTING][::-1]
        running = sorted((s for s in self.slots if s.state == RUNNING),
                         key=lambda s: (s.ongoing, -self.slots.index(s)))
        for slot in (starting + running)[:count]:
            if slot.state == STARTING:
                self._stop(slot)
                continue
            slot.state = DRAINING
            self._free = None
            self.published.pop(slot.replica_id, None)
            for router in self.routers:
                router.drop_view(slot.replica_id)
            if slot.ongoing == 0:
                self._stop(slot)
        self._replicas_changed()
