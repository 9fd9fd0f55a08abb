"""Tenants in the simulated cluster: who each request is for, and how capacity is shared.

A workload names each request's tenant (`WorkloadRequest.tenant`); `SimTenancy` says what
the deployment knows of each (its weight, priority band and TTFT objective, as the keys
file gives them: deploy/tenants.py) and how the cluster shares capacity between them:

    engine_policy     the replicas' scheduling policy, the engine's own objects
                      (replica/scheduling_policy.py): fcfs, priority or fair (VTC)
    slo_admission     each replica refuses at once a request predicted to miss its
                      tenant's TTFT objective (the engine's replica/slo_admission.py)
    gateway           llm-d-style flow control in front of the routers
                      (sim/gateway_flow_control.py): requests held while the pool is
                      saturated, released by band, then fairness between flows, then FCFS
    ingress           the ingress admission queue (sim/ingress_gate.py): requests held
                      while no replica has a free place in its batch, released by band,
                      then cluster-wide VTC counters, then arrival

A request of a tenant the tenancy does not list (or of none) is served as the default
tenant: weight 1, band 0, no objective, as the ingress serves a key with no tenant line.
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.autoscale.ingress_saturation import IngressSaturation
from iterserve.replica.request import TenantShare
from iterserve.replica.scheduling_policy import POLICIES

DEFAULT_TENANT = ""


@dataclass(frozen=True)
class SimTenant:
    """One tenant: its fair-share weight, its priority band (lower runs first) and its
    time-to-first-token objective (None: none)."""

    name: str
    weight: float = 1.0
    priority: int = 0
    ttft_slo_s: float | None = None

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0")
        if self.ttft_slo_s is not None and self.ttft_slo_s <= 0:
            raise ValueError(f"tenant {self.name!r}: ttft_slo_s must be > 0")

    def share(self, outside_engine_s: float) -> TenantShare:
        """What the engine's admission check reads of it (objective in ms)."""
        return TenantShare(self.name, self.weight,
                           None if self.ttft_slo_s is None else self.ttft_slo_s * 1000,
                           outside_engine_s)


@dataclass(frozen=True)
class GatewaySaturation:
    """When llm-d's flow control holds requests: the pool is saturated when every running
    replica is, and a replica is saturated when its waiting queue (as last published, plus
    the requests sent to it since) reaches queue_depth or its KV usage kv_usage. The
    defaults are the Gateway API inference extension's saturation detector's
    (DefaultQueueDepthThreshold 5, DefaultKVCacheUtilThreshold 0.8)."""

    queue_depth: int = 5
    kv_usage: float = 0.8

    def __post_init__(self) -> None:
        if self.queue_depth < 1 or not 0 < self.kv_usage <= 1:
            raise ValueError("queue_depth must be >= 1 and kv_usage in (0, 1]")


@dataclass(frozen=True)
class SimTenancy:
    """The cluster's tenants and how it shares capacity between them (module docstring)."""

    tenants: tuple[SimTenant, ...] = ()
    engine_policy: str = "fcfs"
    slo_admission: bool = False
    slo_headroom: float = 0.8  # the engine's SchedulerConfig.slo_admission_headroom
    gateway: GatewaySaturation | None = None
    ingress: IngressSaturation | None = None

    def __post_init__(self) -> None:
        if self.engine_policy not in ("fcfs", "priority", "fair"):
            known = ", ".join(p for p in POLICIES if p in ("fcfs", "priority", "fair"))
            raise ValueError(f"engine_policy must be one of {known}, got "
                             f"{self.engine_policy!r}")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        if not 0 < self.slo_headroom <= 1:
            raise ValueError("slo_headroom must be in (0, 1]")
        if self.gateway is not None and self.ingress is not None:
            raise ValueError("choose one queue in front of the routers: gateway or ingress")

    def tenant(self, name: str | None) -> SimTenant:
        """The named tenant, or the default one (weight 1, band 0, no objective)."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        return SimTenant(DEFAULT_TENANT)
