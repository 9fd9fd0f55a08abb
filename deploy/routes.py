"""The routes of the OpenAI-compatible API.

Two routers: `api_router`, whose every route requires an API key (the dependency sits on the
router, so a route added there is protected by default), and `open_router`, which holds the
only open routes (/health and /live for probes, /metrics for Prometheus).
tests/unit/test_routes_auth.py lists every route of the app and checks which are open.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}] (LoRA
adapters listed as models with `parent`), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (deploy/lora_adapters.py; 404 unless runtime_lora_root is set),
POST /tokenize, POST /detokenize, GET /debug/replicas; open: GET /health, GET /live,
GET /metrics.

/health is readiness, as vLLM's: 200 only when a request would be served now (a model
replica has answered; with min_replicas 0, as soon as the ingress holds the tokenizer: a
request is then held while a replica starts, and a probe must not start one), 503 while the
model loads and while the server drains. /live is liveness: 200 whenever this ingress
answers, loading and draining included, so a liveness probe does not restart a server that
is loading a model or finishing its streams. The model card, /tokenize and /detokenize are
answered from what the ingress knows (deploy/engine_client.py): no replica is asked.

Bodies are read with a size limit (413) before they are parsed, then validated by pydantic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from iterserve.dashboards.metrics import CONTENT_TYPE, metrics_text
from iterserve.deploy.engine_client import EngineClient
from iterserve.deploy.errors import (
    bad_request,
    body_too_large,
    from_validation_error,
    model_not_found,
)
from iterserve.deploy.handlers import create_chat_completion, create_completion
from iterserve.deploy.lifecycle import ServingState
from iterserve.deploy.lora_adapters import LoRAAdapters, lora_router
from iterserve.deploy.protocol import ModelInfo, chat_prompt
from iterserve.deploy.schemas import ChatCompletionRequest, CompletionRequest
from iterserve.deploy.schemas_tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from iterserve.deploy.tenant_requests import Tenancy
from iterserve.deploy.tenants import DEFAULT, SUB_TENANT_HEADER, Caller
from iterserve.deploy.tool_calls import ToolSettings

Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, model: type[Body], limit: int) -> Body:
    """The request body parsed as `model`; 413 past `limit` bytes, 400 for bad JSON."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad_request("Invalid Content-Length header.")
        if int(declared) > limit:
            raise body_too_large(limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise body_too_large(limit)
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return model.model_validate_json(bytes(raw))
    except ValidationError as error:
        if any(e.get("type") == "json_invalid" for e in error.errors()):
            raise bad_request("The request body is not valid JSON.") from error
        raise from_validation_error(error) from error


def caller_of(request: Request, user: str | None) -> Caller:
    """The request's caller (its key's tenant, left by the key check) with the sub-tenant
    its header or `user` field names, where its tenant allows one; a 400 for an unknown one."""
    caller: Caller = getattr(request.state, "caller", None) or Caller(DEFAULT)
    try:
        return caller.naming(request.headers.get(SUB_TENANT_HEADER), user)
    except ValueError as error:
        param = "user" if caller.tenant.sub_tenant_from == "user" else None
        raise bad_request(str(error), param=param) from None


def check_model(requested: str | None, info: ModelInfo, aliases: Iterable[str],
                adapters: Iterable[str] = ()) -> None:
    if (requested and requested != info.model_name and requested not in aliases
            and requested not in adapters):
        raise model_not_found(requested)


def model_card(info: ModelInfo) -> ModelCard:
    metadata = dict(info.config)
    metadata["max_model_len"] = info.max_model_len
    metadata["max_logprobs"] = info.max_logprobs
    return ModelCard(id=info.model_name, root=info.model_name,
                     max_model_len=info.max_model_len, metadata=metadata)


def _metrics_text() -> tuple[bytes, str]:
    """Prometheus text: every process's iterserve metrics, merged when the launcher enabled
    prometheus_client's multiprocess mode; else this process's registry."""
    return metrics_text(), CONTENT_TYPE


def api_router(client: EngineClient, limit: int, model_aliases: Iterable[str],
               require_api_key: Callable[[Request], None],
               tools: ToolSettings | None = None, tenancy: Tenancy | None = None) -> APIRouter:
    """Every route that needs a key; `tools` are --chat-template and --tool-call-parser;
    `tenancy` the tenants' quotas, cache isolation and metrics (deploy/tenant_requests.py)."""
    tools = tools or ToolSettings()
    tenancy = tenancy or Tenancy()
    router = APIRouter(dependencies=[Depends(require_api_key)])
    model_aliases = tuple(model_aliases)
    adapters = LoRAAdapters(client, model_aliases)

    async def read(request: Request, model: type[Body]) -> Body:
        return await read_body(request, model, limit)

    router.include_router(lora_router(client, adapters, read))

    @router.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, limit)
        info = await client.model_info()
        lora = await adapters.request_for(body.model, info)
        check_model(body.model, info, model_aliases, [lora.name] if lora else ())
        return await create_completion(body, client, info, tenancy, caller_of(request, body.user),
                                       lora)

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, limit)
        info = await client.model_info()
        lora = await adapters.request_for(body.model, info)
        check_model(body.model, info, model_aliases, [lora.name] if lora else ())
        return await create_chat_completion(body, client, info, tools, tenancy,
                                            caller_of(request, body.user), lora)

    @router.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        info = await client.model_info()
        base = model_card(info)
        cards = await adapters.cards(info, base)
        return JSONResponse(ModelList(data=[base, *cards]).model_dump())

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        info = await client.model_info()
        check_model(model_id, info, model_aliases, await adapters.all(info, model_id))
        base = model_card(info)
        card = next((c for c in await adapters.cards(info, base) if c.id == model_id), base)
        return JSONResponse(card.model_dump())

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_body(request, TokenizeRequest, limit)
        info = await client.model_info()
        check_model(body.model, info, model_aliases)
        tokenizer = await client.tokenizer()
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages,
                                         add_generation_prompt=body.add_generation_prompt)
            template = tools.template_for(chat, getattr(tokenizer, "chat_template", None))
            ids = chat_prompt(chat, tokenizer, chat_template=template)
        else:
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        out = TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids)
        return JSONResponse(out.model_dump())

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_body(request, DetokenizeRequest, limit)
        info = await client.model_info()
        check_model(body.model, info, model_aliases)
        if info.vocab_size is not None and any(t >= info.vocab_size for t in body.tokens):
            raise bad_request(f"tokens must be in [0, {info.vocab_size}).", param="tokens")
        tokenizer = await client.tokenizer()
        text = tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @router.get("/debug/replicas")
    async def replicas(request: Request) -> JSONResponse:
        """Every replica's live engine stats (a control-plane broadcast; not for hot paths)."""
        infos: list[dict[str, Any]] = await client.replica_infos()
        return JSONResponse({"object": "list", "data": infos})

    return router


def open_router(client: EngineClient, state: ServingState) -> APIRouter:
    """The only routes without a key: readiness, liveness and Prometheus scrapes."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not await client.ready():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/live")
    async def live() -> JSONResponse:
        return JSONResponse({"status": "draining" if state.draining else "ok"})

    @router.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = _metrics_text()
        return PlainTextResponse(payload, media_type=content_type)

    return router
