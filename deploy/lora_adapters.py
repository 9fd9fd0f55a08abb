"""The ingress's LoRA adapters: which model names are adapters, and the runtime load/unload.

Every adapter is served as a model name of its own (`/v1/models` lists it with `parent` set
to the base model); a request naming it carries a `LoRARequest` (name, folder and the
version of its load) to its replica, so a replica started later by the autoscaler, or
restarted, reads the adapter on its first request for it, once the cluster's registry
(deploy/lora_registry.py: one record for every ingress, outliving them) says that version
is still loaded.

Adapters come from `lora_modules` (the engine config, every replica loads them at start) and
from `POST /v1/load_lora_adapter` (vLLM's body: lora_name, lora_path), which is off unless
`runtime_lora_root` is set and reads only folders under it: an API key must not become a way
to read arbitrary files. A load reserves the name in the registry, is broadcast to the
running replicas, and is published only if every one accepted it (a malformed adapter: 400
naming the problem). `POST /v1/unload_lora_adapter` (lora_name) retires the adapter (no
ingress admits it, no replica reads it back), waits for the requests still using it to end
(up to the engine setting `lora_unload_wait_s`, 60 s by default; past it a 409 and the adapter
is served again: retry, nothing is lost),
then drops it everywhere. A request admitted just before an unload either runs to its end
with the adapter (the unload waits for it) or gets the 404; an unload wins.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from iterserve.deploy.engine_client import EngineClient
from iterserve.deploy.errors import OpenAIHTTPError, bad_request, model_not_found
from iterserve.deploy.lora_registry import AdapterEntry, AdapterRecord
from iterserve.deploy.protocol import ModelInfo
from iterserve.deploy.schemas_tokens import ModelCard
from iterserve.replica.config import EngineConfig
from iterserve.replica.lora_adapter import LoRARequest

logger = logging.getLogger(__name__)

# How stale an ingress's view of the runtime loads may be for a name it already knows: an
# unload through another ingress is seen within this. A request admitted meanwhile runs on a
# replica still holding the adapter (the unload waits for it) or gets the 404 from one that
# dropped it (a replica asks the registry before reading an adapter back).
SNAPSHOT_TTL_S = 1.0
# How often an unload asks the replicas again while requests still use the adapter.
UNLOAD_POLL_S = 0.2


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's body carries it; names identify adapters here


class LoRAAdapters:
    """The adapters the cluster serves: lora_modules' (from the model's config) and those
    loaded at run time (the registry every ingress shares, deploy/lora_registry.py), read
    through a snapshot at most SNAPSHOT_TTL_S old; a name the snapshot lacks is looked up
    afresh, so a load through another ingress is served here at once."""

    def __init__(self, client: EngineClient, model_aliases: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client  # its `adapters`: the registry, read when first needed
        self._aliases = frozenset(model_aliases)  # names of the base model: never looked up
        self._clock = clock
        self._snapshot: dict[str, AdapterEntry] = {}
        self._taken_at = -math.inf

    async def _runtime(self, info: ModelInfo, wanted: str | None = None
                       ) -> dict[str, AdapterEntry]:
        """The runtime loads; none unless runtime loading is on (then no registry is asked)."""
        if not info.config.get("runtime_lora_root"):
            return {}
        stale = self._clock() - self._taken_at > SNAPSHOT_TTL_S
        if stale or (wanted is not None and wanted not in self._snapshot
                     and not self._names_base(wanted, info)):
            self._snapshot = await self._registry().loaded()
            self._taken_at = self._clock()
        return self._snapshot

    async def all(self, info: ModelInfo, wanted: str | None = None) -> dict[str, str]:
        """Every adapter's name -> folder (`wanted`: the name a request asks for)."""
        runtime = await self._runtime(info, wanted)
        return {**static_adapters(info.config),
                **{name: entry.path for name, entry in runtime.items()}}

    async def request_for(self, model: str | None, info: ModelInfo) -> LoRARequest | None:
        """The adapter a request's `model` names (with the version it is admitted with),
        None for the base model or an alias."""
        if not model or self._names_base(model, info):
            return None
        static = static_adapters(info.config)
        if model in static:
            return LoRARequest(model, static[model])
        entry = (await self._runtime(info, model)).get(model)
        return LoRARequest(model, entry.path, entry.version) if entry is not None else None

    def _registry(self) -> AdapterRecord:
        return self._client.adapters

    def _names_base(self, model: str, info: ModelInfo) -> bool:
        return model == info.model_name or model in self._aliases

    async def cards(self, info: ModelInfo, base: ModelCard) -> list[ModelCard]:
        """The adapters' model cards, from the registry as it is now (every ingress lists
        the same adapters)."""
        self._taken_at = -math.inf
        return [ModelCard(id=name, root=path, parent=base.id, max_model_len=base.max_model_len)
                for name, path in (await self.all(info)).items()]

    async def load(self, body: LoadLoRAAdapterRequest, info: ModelInfo) -> str:
        """Reserve the name in the registry, read the adapter on every running replica,
        then publish it (a replica's refusal, a 400 naming the problem, drops it)."""
        root = runtime_root(info)
        name = body.lora_name
        if name == info.model_name or name in await self.all(info, name):
            raise already_loaded(name)
        path = path_under_root(body.lora_path, root)
        entry = await self._registry().add(name, path)
        if entry is None:  # being unloaded, or loaded through another ingress meanwhile
            raise already_loaded(name)
        try:
            await self._client.lora_adapter("load", name, path)
        except BaseException:
            await self._forget_load(name, entry.version)
            raise
        await self._registry().publish(name, entry.version)
        self._taken_at = -math.inf
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _forget_load(self, name: str, version: int) -> None:
        """A load some replica refused: the replicas that read it drop it again (those that
        never had it count as done), then the registry frees the name."""
        try:
            await self._client.lora_adapter("unload", name)
        except OpenAIHTTPError as error:  # logged: the load's own error is the answer
            logger.warning("adapter %r stays on a replica after its failed load: %s", name,
                           error)
        await self._registry().drop(name, version)

    async def unload(self, body: UnloadLoRAAdapterRequest, info: ModelInfo) -> str:
        """Retire the adapter (no ingress admits it, no replica reads it back), unload it
        on every running replica, waiting for the requests that still use it, then drop it;
        if they outlast the wait (409) it is published again."""
        runtime_root(info)
        name = body.lora_name
        if name in static_adapters(info.config):
            raise bad_request(f"The lora adapter '{name}' comes from lora_modules and "
                              "cannot be unloaded.", param="lora_name")
        entry = await self._registry().retire(name)
        if entry is None:
            raise model_not_found(name)
        self._taken_at = -math.inf
        try:
            await self._unload_everywhere(name, float(info.config["lora_unload_wait_s"]))
        except BaseException:
            await self._registry().publish(name, entry.version)
            raise
        await self._registry().drop(name, entry.version)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _unload_everywhere(self, name: str, wait_s: float) -> None:
        """Ask every running replica to unload `name` until none refuses for requests still
        using it (409): the adapter is retired, so no new request joins them and they only
        end. Past `wait_s` the 409 is the answer. A replica that already dropped it answers
        as done."""
        deadline = self._clock() + wait_s
        while True:
            try:
                await self._client.lora_adapter("unload", name)
                return
            except OpenAIHTTPError as error:
                if error.status_code != 409 or self._clock() >= deadline:
                    raise
            await asyncio.sleep(UNLOAD_POLL_S)


def static_adapters(config: dict[str, Any]) -> dict[str, str]:
    """lora_modules of the model's flat config, as {name: path}."""
    if not config.get("enable_lora"):
        return {}
    return EngineConfig(enable_lora=True, lora_modules=config.get("lora_modules")
                        ).lora_module_paths


def already_loaded(name: str) -> OpenAIHTTPError:
    return bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")


def runtime_root(info: ModelInfo) -> Path:
    """The folder runtime loads read under; 404 when runtime loading is off (as if the
    route did not exist, as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    root = info.config.get("runtime_lora_root")
    if not root:
        raise OpenAIHTTPError(404, "Runtime LoRA loading is off; start the server with "
                              "--runtime-lora-root DIR to enable it.", "not_found_error")
    return Path(root).resolve()


def path_under_root(path: str, root: Path) -> str:
    """`path` (absolute, or relative to the root) resolved, if it lies under `root`: links
    and `..` are resolved first, so neither leads out of it."""
    candidate = Path(path)
    resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if resolved != root and root not in resolved.parents:
        raise bad_request(f"lora_path {path!r} is outside the runtime LoRA root; adapters "
                          "load only from under it.", param="lora_path")
    return str(resolved)


def lora_router(client: EngineClient, adapters: LoRAAdapters,
                read: Any) -> APIRouter:  # noqa: ANN401 - routes.read_body, bound to a limit
    """The two runtime routes; mounted on the API router, so they need a key."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read(request, LoadLoRAAdapterRequest)
        return PlainTextResponse(await adapters.load(body, await client.model_info()))

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read(request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await adapters.unload(body, await client.model_info()))

    return router
