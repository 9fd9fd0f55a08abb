"""LLMEngine's LoRA side: the adapters it serves, registered and unregistered at run time.

The runner owns the adapters' weights (`ModelRunner.lora`, a LoRAManager); the engine checks
requests' adapter names against it, and refuses to unload an adapter that requests still use
(AdapterInUseError, the API's 409: the caller retries once they finish, as nothing is lost).
"""

from __future__ import annotations

from pathlib import Path

from iterserve.replica.config import EngineConfig
from iterserve.replica.constrained_requests import ConstrainedRequests
from iterserve.replica.lora_manager import LoRAManager, UnknownAdapterError
from iterserve.replica.request import Request
from iterserve.replica.runner_base import Runner
from iterserve.replica.scheduler import Scheduler


class AdapterInUseError(RuntimeError):
    """An unload of an adapter that running or waiting requests still use."""


class LoRADisabledError(ValueError):
    """A LoRA operation on an engine started without enable_lora."""


class EngineLoRA:
    """Mixed into LLMEngine, which provides these attributes."""

    runner: Runner
    scheduler: Scheduler
    pending_children: dict[str, list[Request]]  # later children of n > 1, not yet scheduled
    constrained: ConstrainedRequests  # requests held while their grammar compiles

    def init_lora(self, config: EngineConfig) -> None:
        self.lora: LoRAManager | None = getattr(self.runner, "lora", None)
        for name, path in config.lora_module_paths.items():
            self.add_lora(name, path)

    def add_lora(self, name: str, path: str | Path) -> None:
        """Read, check and serve the adapter in `path` as model `name` (LoRALoadError names
        what is wrong with it). Runs in the caller's thread: the running batch goes on."""
        self._lora_manager().register(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving `name`: UnknownAdapterError if not served, AdapterInUseError while
        requests use it."""
        manager = self._lora_manager()
        held = [r for children in self.pending_children.values() for r in children]
        held += [r for _, children in self.constrained.held.values() for r in children]
        users = sum(1 for r in [*self.scheduler.unfinished_requests(), *held]
                    if r.lora_name == name)
        if users:
            raise AdapterInUseError(f"adapter {name!r} is used by {users} unfinished "
                                    "request(s); unload it once they finish")
        manager.unregister(name)

    def list_loras(self) -> list[str]:
        return self.lora.names() if self.lora is not None else []

    def resident_loras(self) -> list[str]:
        return self.lora.resident() if self.lora is not None else []

    def check_lora_name(self, name: str | None) -> None:
        """Raise UnknownAdapterError unless `name` is None or a served adapter."""
        if name is not None and (self.lora is None or not self.lora.has(name)):
            raise UnknownAdapterError(name)

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise LoRADisabledError("LoRA adapters need an engine started with enable_lora")
        return self.lora
