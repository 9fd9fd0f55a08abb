"""KV pulls in the simulated cluster (`cluster.ClusterSim`'s events for sim/kv_pull.py): a
request routed to a replica that should pull its prefix reaches that replica only once the
blocks have been read from the holder (PULL_READ) and have crossed the wire (PULL_LANDED); a
failed read (the holder stopped, or evicted them meanwhile) sends it on to compute. A mixin of
`ClusterSim`, as the controller's loop is (cluster_controller.py): it reads the cluster's slots
and prefix caches and schedules its events through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from iterserve.autoscale.sim.cluster_controller import PULL_LANDED
from iterserve.autoscale.sim.kv_pull import PullPlan
from iterserve.autoscale.sim.state import DRAINING, RUNNING, ReplicaSlot
from iterserve.autoscale.sim.workload import WorkloadRequest

if TYPE_CHECKING:
    from iterserve.autoscale.sim.cluster import ClusterSim


class KVPullEvents:
    def _plan_pull(self: ClusterSim, spec: WorkloadRequest, slot: ReplicaSlot) -> PullPlan | None:
        live = {s.replica_id: s.replica for s in self.slots if s.state in (RUNNING, DRAINING)}
        prompt = spec.prompt_token_ids
        answers = self._prefix_tiers(prompt, list(live)) if self._prefix_tiers is not None \
            else {rid: [n] for rid, n in self.prefix_cache(prompt, list(live)).items()}
        return self.pulls.plan(spec, slot.replica, answers, live)

    def _on_pull_read(self: ClusterSim, pull: PullPlan) -> None:
        holder = self._slot_by_id[pull.holder]
        if holder.state in (RUNNING, DRAINING):
            self._touch(holder)  # its cache as it is now: it may have evicted them meanwhile
        wire_s = self.pulls.read(pull, holder.replica if holder.state in (RUNNING, DRAINING)
                                 else None)
        if wire_s is None:  # failed: the request computes the prefix
            self._arrive_pulled(pull)
        else:
            self._push(self.now + wire_s, PULL_LANDED, pull)

    def _on_pull_landed(self: ClusterSim, pull: PullPlan) -> None:
        slot = self._slot_by_id[pull.receiver]
        self._touch(slot)
        self.pulls.land(pull, slot.replica)
        self._arrive_pulled(pull)

    def _arrive_pulled(self: ClusterSim, pull: PullPlan) -> None:
        slot = self._slot_by_id[pull.receiver]  # in flight there: it did not stop
        self._touch(slot)
        slot.replica.add(pull.spec, self.now)
        self._schedule_wake(slot)
