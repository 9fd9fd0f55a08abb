"""The ingress's LoRA adapters: which model names are adapters, and the runtime load/unload.

Every adapter is served as a model name of its own (`/v1/models` lists it with `parent` set
to the base model); a request naming it carries a `LoRARequest` (name and folder) to its
replica, so a replica started later by the autoscaler, or restarted, reads the adapter on its
first request for it: the registry that survives replicas is this one, in the ingress.

Adapters come from `lora_modules` (the engine config, every replica loads them at start) and
from `POST /v1/load_lora_adapter` (vLLM's body: lora_name, lora_path), which is off unless
`runtime_lora_root` is set and reads only folders under it: an API key must not become a way
to read arbitrary files. A load is broadcast to the running replicas first and registered
only if every one accepted it (a malformed adapter: 400 naming the problem).
`POST /v1/unload_lora_adapter` (lora_name) answers 409 while requests still use the adapter
on some replica (retry once they finish: nothing is lost), else unregisters it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from iterserve.deploy.engine_client import EngineClient
from iterserve.deploy.errors import OpenAIHTTPError, bad_request, model_not_found
from iterserve.deploy.protocol import ModelInfo
from iterserve.deploy.schemas_tokens import ModelCard
from iterserve.replica.config import EngineConfig
from iterserve.replica.lora_adapter import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's body carries it; names identify adapters here


class LoRAAdapters:
    """The adapters this ingress serves: lora_modules' (from the model's config) and those
    loaded at run time."""

    def __init__(self) -> None:
        self._runtime: dict[str, str] = {}

    def all(self, info: ModelInfo) -> dict[str, str]:
        """Every adapter's name -> folder."""
        return {**static_adapters(info.config), **self._runtime}

    def request_for(self, model: str | None, info: ModelInfo) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the base model."""
        if not model:
            return None
        path = self.all(info).get(model)
        return LoRARequest(model, path) if path is not None else None

    def cards(self, info: ModelInfo, base: ModelCard) -> list[ModelCard]:
        return [ModelCard(id=name, root=path, parent=base.id, max_model_len=base.max_model_len)
                for name, path in self.all(info).items()]

    async def load(self, body: LoadLoRAAdapterRequest, client: EngineClient,
                   info: ModelInfo) -> str:
        root = runtime_root(info)
        name = body.lora_name
        if name == info.model_name or name in self.all(info):
            raise bad_request(f"The lora adapter '{name}' has already been loaded.",
                              param="lora_name")
        path = path_under_root(body.lora_path, root)
        await client.lora_adapter("load", name, path)
        self._runtime[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest, client: EngineClient,
                     info: ModelInfo) -> str:
        runtime_root(info)
        name = body.lora_name
        if name not in self._runtime:
            if name in static_adapters(info.config):
                raise bad_request(f"The lora adapter '{name}' comes from lora_modules and "
                                  "cannot be unloaded.", param="lora_name")
            raise model_not_found(name)
        await client.lora_adapter("unload", name)
        del self._runtime[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def static_adapters(config: dict[str, Any]) -> dict[str, str]:
    """lora_modules of the model's flat config, as {name: path}."""
    if not config.get("enable_lora"):
        return {}
    return EngineConfig(enable_lora=True, lora_modules=config.get("lora_modules")
                        ).lora_module_paths


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
        return PlainTextResponse(await adapters.load(body, client, await client.model_info()))

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read(request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await adapters.unload(body, client, await client.model_info()))

    return router
