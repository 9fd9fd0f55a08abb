"""The cluster's registry of runtime-loaded LoRA adapters: one record every ingress reads.

A runtime load (`POST /v1/load_lora_adapter`) is recorded here, not in the ingress replica
that took it, so every ingress answers `/v1/models` with the same adapters and serves them,
and the record outlives an ingress restart. `lora_modules` stay in the config (every
replica loads them at start); only runtime loads live here.

Each load gets a version (vLLM's lora_int_id, but never reused): a request carries the
version its ingress admitted it with, and a replica that must read the adapter back (it
started later, or an unload dropped it) first asks the registry whether that version is
still loaded. Both a load and an unload hold the entry pending (no ingress admits it, no
replica reads it back) while they reach the running replicas: a load then publishes it (or
drops it if a replica refused the adapter), an unload drops it (or publishes it again if a
replica refused: 409, requests still use it). So no replica is left holding an unloaded
adapter, and a name is never loaded twice at once (deploy/lora_adapters.py,
replica/async_engine.py).

`RayAdapterRegistry` keeps the one `AdapterRegistry` of an application in a named Ray actor,
as the tenants' quota ledger does (deploy/quotas.py). It is detached: an actor is owned by
the process that created it, here an ingress replica, and would die with it, taking the
adapters with it. If the actor itself dies (its node lost, a kill), the next call finds a new,
empty one under the name, and the caller first restores into it the adapters it last read
(every ingress reads them at least once a second): an adapter loaded in the cluster stays
loaded, with its version, so requests admitted before keep theirs. A load or unload in flight
when the actor died is not restored (its caller's publish or drop finds no entry: a load so
lost is answered but not listed; load it again). `LocalAdapterRegistry` holds one in this
process (the in-process server).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from iterserve.deploy.errors import OpenAIHTTPError

logger = logging.getLogger(__name__)

REGISTRY_ACTOR_ERRORS = ("ActorDiedError", "RayActorError", "ActorUnavailableError")
REGISTRY_TIMEOUT_S = 10.0  # past it, a 503: an adapter is never served unchecked
Answer = TypeVar("Answer")


@dataclass(frozen=True)
class AdapterEntry:
    """One runtime-loaded adapter: its folder (resolved under the runtime root) and the
    version its load was given."""

    path: str
    version: int


class AdapterRegistry:
    """Name -> entry for every runtime load. A pending entry is being loaded or unloaded:
    neither listed nor current, and its name not free until published or dropped."""

    def __init__(self) -> None:
        self._entries: dict[str, AdapterEntry] = {}
        self._pending: set[str] = set()
        self._next_version = 1  # 0: a lora_modules adapter, never unloaded

    def loaded(self) -> dict[str, AdapterEntry]:
        """The adapters a request may name now."""
        return {name: entry for name, entry in self._entries.items()
                if name not in self._pending}

    def add(self, name: str, path: str) -> AdapterEntry | None:
        """Begin a load: a pending entry with a new version; None when the name is taken."""
        if name in self._entries:
            return None
        self._pending.add(name)
        entry = self._entries[name] = AdapterEntry(path, self._next_version)
        self._next_version += 1
        return entry

    def restore(self, entries: dict[str, AdapterEntry]) -> None:
        """Serve again what a registry that died served (a caller's last read of it): each
        name this registry does not know, with its version; later loads get newer ones."""
        for name, entry in entries.items():
            if name not in self._entries:
                self._entries[name] = entry
            self._next_version = max(self._next_version, entry.version + 1)

    def retire(self, name: str) -> AdapterEntry | None:
        """Begin an unload: the entry stops being served; None if not loaded (or already
        pending)."""
        if name not in self._entries or name in self._pending:
            return None
        self._pending.add(name)
        return self._entries[name]

    def publish(self, name: str, version: int) -> None:
        """Serve `version`: its load reached every replica, or its unload was refused."""
        if self._is(name, version):
            self._pending.discard(name)

    def drop(self, name: str, version: int) -> None:
        """Forget `version`: its unload reached every replica, or its load failed."""
        if self._is(name, version):
            del self._entries[name]
            self._pending.discard(name)

    def is_current(self, name: str, version: int) -> bool:
        """Whether `version` of `name` is loaded and not pending: a replica reads an
        adapter back only then."""
        return self._is(name, version) and name not in self._pending

    def _is(self, name: str, version: int) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.version == version


class AdapterRecord(Protocol):
    """The registry as the ingress and the replicas reach it (here, or in a Ray actor)."""

    async def loaded(self) -> dict[str, AdapterEntry]: ...

    async def add(self, name: str, path: str) -> AdapterEntry | None: ...

    async def retire(self, name: str) -> AdapterEntry | None: ...

    async def publish(self, name: str, version: int) -> None: ...

    async def drop(self, name: str, version: int) -> None: ...

    async def is_current(self, name: str, version: int) -> bool: ...


class LocalAdapterRegistry:
    """A registry in this process: the in-process server, whose one engine is its replica."""

    def __init__(self, registry: AdapterRegistry | None = None) -> None:
        self.registry = registry or AdapterRegistry()

    async def loaded(self) -> dict[str, AdapterEntry]:
        return self.registry.loaded()

    async def add(self, name: str, path: str) -> AdapterEntry | None:
        return self.registry.add(name, path)

    async def retire(self, name: str) -> AdapterEntry | None:
        return self.registry.retire(name)

    async def publish(self, name: str, version: int) -> None:
        self.registry.publish(name, version)

    async def drop(self, name: str, version: int) -> None:
        self.registry.drop(name, version)

    async def is_current(self, name: str, version: int) -> bool:
        return self.registry.is_current(name, version)


def registry_actor_name(app_name: str) -> str:
    return f"iterserve-lora-adapters:{app_name}"


class RayAdapterRegistry:
    """The application's registry in a named, detached Ray actor: created by the first
    ingress or replica that asks, found by the others."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._actor: Any = None
        self._last_loaded: dict[str, AdapterEntry] = {}  # restored into a new actor

    def _handle(self) -> Any:  # noqa: ANN401 - a Ray actor handle
        if self._actor is None:
            import ray

            actor_class = ray.remote(num_cpus=0, max_concurrency=1)(AdapterRegistry)
            self._actor = actor_class.options(name=self._name, namespace="serve",
                                              lifetime="detached",
                                              get_if_exists=True).remote()
        return self._actor

    async def _ask(self, call: Callable[[Any], Any]) -> Any:  # noqa: ANN401 - the answer
        """The actor's answer to `call(handle)`; the actor found again once if it is gone;
        a 503 when it cannot answer within REGISTRY_TIMEOUT_S."""
        for attempt in (1, 2):
            try:
                if attempt == 2 and self._last_loaded:
                    await asyncio.wait_for(self._handle().restore.remote(self._last_loaded),
                                           REGISTRY_TIMEOUT_S)
                return await asyncio.wait_for(call(self._handle()), REGISTRY_TIMEOUT_S)
            except asyncio.TimeoutError:
                break
            except Exception as error:  # noqa: BLE001 - only "the actor is gone" is retried
                if type(error).__name__ not in REGISTRY_ACTOR_ERRORS or attempt == 2:
                    raise
                logger.warning("the LoRA registry actor is gone (%s); asking for it again "
                               "and restoring the %d adapters last read from it",
                               type(error).__name__, len(self._last_loaded))
                self._actor = None
        raise OpenAIHTTPError(503, "The LoRA adapter registry did not answer; retry later.",
                              "service_unavailable", headers={"Retry-After": "1"})

    async def loaded(self) -> dict[str, AdapterEntry]:
        self._last_loaded = await self._ask(lambda actor: actor.loaded.remote())
        return self._last_loaded

    async def add(self, name: str, path: str) -> AdapterEntry | None:
        return await self._ask(lambda actor: actor.add.remote(name, path))

    async def retire(self, name: str) -> AdapterEntry | None:
        return await self._ask(lambda actor: actor.retire.remote(name))

    async def publish(self, name: str, version: int) -> None:
        await self._ask(lambda actor: actor.publish.remote(name, version))

    async def drop(self, name: str, version: int) -> None:
        await self._ask(lambda actor: actor.drop.remote(name, version))

    async def is_current(self, name: str, version: int) -> bool:
        return bool(await self._ask(lambda actor: actor.is_current.remote(name, version)))
