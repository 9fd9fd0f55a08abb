"""Simulated LoRA adapters on a replica: which are resident, and what a load costs.

The engine's three tiers (replica/lora_manager.py): every adapter is registered (on disk);
up to `max_cpu_loras` sit read in host memory (LRU); up to `max_loras` fill the device
slots (LRU among those the running requests do not use). The scheduler admits at most
`max_loras` distinct adapters into the running batch (`Scheduler(max_loras=...)`, the
engine's own rule: admission waits), so a step always finds a slot for each.

A step whose running requests use an adapter that is not in a device slot lasts the load
longer, before its forward: from host memory a copy (adapter_bytes / host_to_device_bytes_s),
from disk a read and the copy (adapter_bytes / disk_read_bytes_s on top). The loads stall the
step they land in (and so every request in it): the engine copies into a slot inside a step.

The defaults are SIMULATED ASSUMPTIONS, not measurements: a rank-16 adapter of Llama-3-8B on
all seven projections (q, k, v, o, gate, up, down) in bf16 is 41.9 M parameters, 84 MB;
host-to-device 25 GB/s (PCIe Gen5 x16, effective); a local NVMe read 2 GB/s. A load from
disk then costs ~45 ms, from host ~3.4 ms.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

LLAMA3_8B_RANK16_ADAPTER_BYTES = 84_000_000


@dataclass(frozen=True)
class SimLoRA:
    """A replica's adapter slots and the simulated cost of loading an adapter."""

    max_loras: int = 8  # device slots (vLLM --max-loras)
    max_cpu_loras: int = 32  # host LRU (vLLM --max-cpu-loras)
    adapter_bytes: int = LLAMA3_8B_RANK16_ADAPTER_BYTES
    host_to_device_bytes_s: float = 25e9
    disk_read_bytes_s: float = 2e9

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError("need 1 <= max_loras <= max_cpu_loras")
        if self.adapter_bytes < 0 or self.host_to_device_bytes_s <= 0 \
                or self.disk_read_bytes_s <= 0:
            raise ValueError("adapter_bytes must be >= 0 and the bandwidths > 0")

    @property
    def host_load_s(self) -> float:
        return self.adapter_bytes / self.host_to_device_bytes_s

    @property
    def disk_load_s(self) -> float:
        return self.adapter_bytes / self.disk_read_bytes_s + self.host_load_s


class AdapterResidency:
    """One replica's device slots and host LRU, and how many loads it has paid for."""

    def __init__(self, config: SimLoRA) -> None:
        self.config = config
        self.device: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.host: OrderedDict[str, None] = OrderedDict()  # holds the device's too
        self.loads_from_host = 0
        self.loads_from_disk = 0
        self.ever_read: set[str] = set()  # every adapter this replica has read from disk

    def held(self) -> frozenset[str]:
        """What the replica reports holding: every adapter it can serve without a disk read
        (the host LRU, which holds the device slots' adapters too)."""
        return frozenset(self.host)

    def load_seconds(self, in_use: Iterable[str]) -> float:
        """Make the adapters the step's running requests use resident on the device; the
        seconds their loads add to the step. ValueError for more than max_loras of them
        (the scheduler's admission rule prevents it)."""
        needed = set(in_use)
        if len(needed) > self.config.max_loras:
            raise ValueError(f"{len(needed)} adapters in one step, max_loras is "
                             f"{self.config.max_loras}")
        seconds = 0.0
        for name in sorted(needed):  # sorted: the same evictions whatever the set's order
            if name in self.device:
                self.device.move_to_end(name)
                self.host.move_to_end(name)
                continue
            if name in self.host:
                self.loads_from_host += 1
                seconds += self.config.host_load_s
                self.host.move_to_end(name)
                self._hold_on_device(name, needed)
            else:
                self.loads_from_disk += 1
                self.ever_read.add(name)
                seconds += self.config.disk_load_s
                self._hold_on_device(name, needed)
                self._hold_in_host(name, needed)
        return seconds

    def _hold_on_device(self, name: str, in_use: set[str]) -> None:
        if len(self.device) >= self.config.max_loras:
            victim = next(n for n in self.device if n not in in_use)
            del self.device[victim]
        self.device[name] = None

    def _hold_in_host(self, name: str, in_use: set[str]) -> None:
        """The host LRU keeps what sits on the device or is in use (a slot's copy comes from
        there); where nothing else is left it holds one more for this step."""
        while len(self.host) >= self.config.max_cpu_loras:
            victim = next((n for n in self.host if n not in in_use and n not in self.device),
                          None)
            if victim is None:
                break
            del self.host[victim]
        self.host[name] = None


def adapter_loads(residencies: Iterable[AdapterResidency]) -> dict[str, int]:
    """The replicas' adapter loads, summed: from host memory and from disk."""
    host = disk = 0
    for residency in residencies:
        host += residency.loads_from_host
        disk += residency.loads_from_disk
    return {"from_host": host, "from_disk": disk}


def adapter_readers(residencies: Iterable[AdapterResidency]) -> dict[str, int]:
    """Each adapter's number of replicas that read it from disk at least once: one read per
    adapter is the cluster's first, each further replica's first read is a spread, and the
    replicas' disk loads beyond these are re-reads after their host LRU dropped it."""
    readers: Counter[str] = Counter()
    for residency in residencies:
        readers.update(residency.ever_read)
    return dict(readers)
