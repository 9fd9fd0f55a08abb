"""The engine's adapters: which exist, which sit in host memory, which fill the device slots.

Three tiers, as vLLM's: every adapter registered (a name and its folder, from `lora_modules`
or a runtime load) can be served; up to `max_cpu_loras` of them are held read in host memory
(LRU: one evicted there is read from its folder again when next used); up to `max_loras` sit
in the device slots the wrapped linears hold (replica/lora_layers.py), LRU among those the
step does not use. A register reads and checks the adapter in the caller's thread, so a
load never stalls the engine's running batch; only the copy into a slot happens in a step.

The scheduler admits at most `max_loras` distinct adapters into one step
(`Scheduler(max_loras=...)`), so `prepare` always finds a slot for each.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from torch import nn

from iterserve.replica.lora_adapter import LoRAAdapter, load_lora_adapter
from iterserve.replica.lora_layers import LoRABatch, LoRALinear
from iterserve.replica.models.config import ModelConfig
from iterserve.replica.outputs import ScheduledRequest

# Our fused linear -> the HF projections in its output slices, in order.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                 "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class UnknownAdapterError(KeyError):
    """A request or unload names an adapter that is not registered (the API's 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"The model `{self.name}` does not exist."


class LoRAManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int) -> None:
        self.model_config = model_config
        self.max_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._device = next(model.parameters()).device
        # CUDA runs the SGMV kernels (kernels/lora_sgmv.py); the CPU the grouped torch path.
        self.batch = LoRABatch(with_segments=self._device.type == "cuda", num_slots=max_loras)
        self.layers = _wrap_linears(model, model_config, max_loras, max_lora_rank, self.batch)
        self._paths: dict[str, str] = {}  # every registered adapter -> its folder
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU, oldest first
        self._slots: list[str | None] = [None] * max_loras
        self._slot_use: list[int] = [0] * max_loras  # the step that last used each slot
        self._steps = 0
        self._lock = threading.Lock()  # registers come from the API's thread

    # -------------------------------------------------------------------- registry
    def register(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and check the adapter (LoRALoadError names what is wrong), then serve it."""
        adapter = load_lora_adapter(name, path, self.model_config, self.max_rank)
        with self._lock:
            self._paths[name] = adapter.path
            self._hold(adapter)
            for slot, held in enumerate(self._slots):  # a re-registered name: reload its slot
                if held == name:
                    self._slots[slot] = None
        return adapter

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._paths:
                raise UnknownAdapterError(name)
            del self._paths[name]
            self._host.pop(name, None)
            self._slots = [None if held == name else held for held in self._slots]

    def hold(self, name: str) -> None:
        """Read `name` back into host memory if the LRU evicted it (call off the engine
        thread: the step then only copies it into a slot)."""
        with self._lock:
            path = self._paths.get(name)
            if path is None or name in self._host:
                return
        adapter = load_lora_adapter(name, path, self.model_config, self.max_rank)
        with self._lock:
            if name in self._paths:
                self._hold(adapter)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._paths)

    def resident(self) -> list[str]:
        """The adapters a request can use here without reading a folder: those in host
        memory (the LRU of max_cpu_loras) or in a device slot. What a replica reports as
        held: every replica registers every adapter the cluster loaded, so the registry
        says nothing of where one is cheap to serve."""
        with self._lock:
            return sorted(set(self._host).union(name for name in self._slots if name))

    def has(self, name: str) -> bool:
        return name in self._paths

    # ---------------------------------------------------------------------- per step
    def prepare(self, scheduled: list[ScheduledRequest]) -> None:
        """Set the step's rows -> slots from each scheduled request's adapter, placing the
        adapters it needs into slots first."""
        self._steps += 1
        token_slots: list[int] = []
        needed = {s.request.lora_name for s in scheduled if s.request.lora_name}
        slot_of = {name: self._slot_for(name, needed) for name in sorted(needed)}
        for item in scheduled:
            name = item.request.lora_name
            token_slots.extend([slot_of[name] if name else -1] * item.num_new_tokens)
        self.batch.assign(token_slots, self._device)

    def _slot_for(self, name: str, needed: set[str]) -> int:
        if name in self._slots:
            slot = self._slots.index(name)
        else:
            free = [s for s, held in enumerate(self._slots) if held not in needed]
            if not free:
                raise RuntimeError(f"more than {len(self._slots)} adapters in one step "
                                   "(the scheduler admits at most max_loras)")
            slot = min(free, key=lambda s: (self._slots[s] is not None, self._slot_use[s]))
            self._place(name, slot)
        self._slot_use[slot] = self._steps
        return slot

    def _place(self, name: str, slot: int) -> None:
        with self._lock:
            path = self._paths.get(name)
            if path is None:
                raise UnknownAdapterError(name)
            adapter = self._host.get(name)
            if adapter is None:  # evicted from host memory: read from its folder again
                adapter = load_lora_adapter(name, path, self.model_config, self.max_rank)
                self._hold(adapter)
            self._host.move_to_end(name)
        for (layer_index, fused), wrapped in self.layers.items():
            per_slice = [adapter.weights.get((layer_index, target))
                         for target in FUSED_TARGETS[fused]]
            wrapped.set_slot(slot, per_slice)
        self._slots[slot] = name

    def _hold(self, adapter: LoRAAdapter) -> None:
        """Keep `adapter` in host memory, evicting the least recently used beyond the cap."""
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)


def _wrap_linears(model: nn.Module, cfg: ModelConfig, max_loras: int, max_rank: int,
                  batch: LoRABatch) -> dict[tuple[int, str], LoRALinear]:
    """Replace each decoder layer's four linears by a LoRALinear around it."""
    slices = {"qkv_proj": [(0, cfg.q_size), (cfg.q_size, cfg.kv_size),
                           (cfg.q_size + cfg.kv_size, cfg.kv_size)],
              "o_proj": [(0, cfg.hidden_size)],
              "gate_up_proj": [(0, cfg.intermediate_size),
                               (cfg.intermediate_size, cfg.intermediate_size)],
              "down_proj": [(0, cfg.hidden_size)]}
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for fused in FUSED_TARGETS:
                base = getattr(parent, fused, None)
                if base is None:
                    continue
                lora = LoRALinear(base, slices[fused], max_loras, max_rank, batch)
                setattr(parent, fused, lora)
                wrapped[(index, fused)] = lora
    return wrapped

