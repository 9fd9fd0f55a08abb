"""The FastAPI app of the OpenAI-compatible API, built over any EngineClient.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}],
POST /tokenize, POST /detokenize, GET /debug/replicas, GET /health, GET /metrics.
Bearer keys guard everything except /health and /metrics. Bodies are read with a size limit
(413) before they are parsed, then validated by pydantic; every failure is an OpenAI-shaped
error body, and bad input is never a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, SecretStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.deploy.auth import ApiKeyChecker
from iterserve.deploy.engine_client import EngineClient
from iterserve.deploy.errors import (
    OpenAIHTTPError,
    bad_request,
    body_too_large,
    from_validation_error,
    internal_error,
    model_not_found,
    unauthorized,
)
from iterserve.deploy.handlers import create_chat_completion, create_completion
from iterserve.deploy.protocol import ModelInfo, chat_prompt
from iterserve.deploy.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from iterserve.deploy.tool_calls import ToolSettings

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
OPEN_PATHS = ("/health", "/metrics")
Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class IngressSettings:
    """HTTP-level settings of one ingress (engine settings live in EngineConfig)."""

    api_keys: tuple[SecretStr, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_aliases: tuple[str, ...] = field(default=())  # extra names accepted as `model`
    tools: ToolSettings = field(default_factory=ToolSettings)  # --chat-template, --tool-call-parser

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")

    def __repr__(self) -> str:  # never show keys
        return (f"IngressSettings(num_api_keys={len(self.api_keys)}, "
                f"max_body_bytes={self.max_body_bytes})")


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


def check_model(requested: str | None, info: ModelInfo, aliases: Iterable[str]) -> None:
    if requested and requested != info.model_name and requested not in aliases:
        raise model_not_found(requested)


def model_card(info: ModelInfo) -> ModelCard:
    metadata = dict(info.config)
    metadata["max_model_len"] = info.max_model_len
    metadata["max_logprobs"] = info.max_logprobs
    return ModelCard(id=info.model_name, root=info.model_name,
                     max_model_len=info.max_model_len, metadata=metadata)


def _metrics_text() -> tuple[bytes, str]:
    """Prometheus text: every process's iterserve metrics (dashboards/), merged when the
    launcher enabled prometheus_client's multiprocess mode; else this process's registry."""
    try:
        from iterserve.dashboards.metrics import CONTENT_TYPE, metrics_text
    except ImportError:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(), CONTENT_TYPE_LATEST
    return metrics_text(), CONTENT_TYPE


def create_app(client: EngineClient, settings: IngressSettings | None = None) -> FastAPI:
    """The API over `client`; the Serve ingress and in-process tests build it the same way."""
    settings = settings or IngressSettings()
    keys = ApiKeyChecker(settings.api_keys)
    limit = settings.max_body_bytes
    app = FastAPI(title="iterserve", version="0.1.0", docs_url=None, redoc_url=None)

    def authorize(request: Request) -> None:
        if keys.enabled and not keys.allows(request.headers.get("authorization")):
            raise unauthorized()

    @app.exception_handler(OpenAIHTTPError)
    async def _openai_error(request: Request, error: OpenAIHTTPError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError
                                ) -> JSONResponse:
        return from_validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return OpenAIHTTPError(error.status_code, str(error.detail), err_type).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return internal_error().response()

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        authorize(request)
        body = await read_body(request, CompletionRequest, limit)
        info = await client.model_info()
        check_model(body.model, info, settings.model_aliases)
        return await create_completion(body, client, info)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await read_body(request, ChatCompletionRequest, limit)
        info = await client.model_info()
        check_model(body.model, info, settings.model_aliases)
        return await create_chat_completion(body, client, info, settings.tools)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        authorize(request)
        info = await client.model_info()
        return JSONResponse(ModelList(data=[model_card(info)]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        authorize(request)
        info = await client.model_info()
        check_model(model_id, info, settings.model_aliases)
        return JSONResponse(model_card(info).model_dump())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        authorize(request)
        body = await read_body(request, TokenizeRequest, limit)
        info = await client.model_info()
        check_model(body.model, info, settings.model_aliases)
        tokenizer = await client.tokenizer()
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages,
                                         add_generation_prompt=body.add_generation_prompt)
            ids = chat_prompt(chat, tokenizer, chat_template=settings.tools.chat_template)
        else:
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        out = TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids)
        return JSONResponse(out.model_dump())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        authorize(request)
        body = await read_body(request, DetokenizeRequest, limit)
        info = await client.model_info()
        check_model(body.model, info, settings.model_aliases)
        if info.vocab_size is not None and any(t >= info.vocab_size for t in body.tokens):
            raise bad_request(f"tokens must be in [0, {info.vocab_size}).", param="tokens")
        tokenizer = await client.tokenizer()
        text = tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    @app.get("/debug/replicas")
    async def replicas(request: Request) -> JSONResponse:
        """Every replica's live engine stats (a control-plane broadcast; not for hot paths)."""
        authorize(request)
        infos: list[dict[str, Any]] = await client.replica_infos()
        return JSONResponse({"object": "list", "data": infos})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = _metrics_text()
        return PlainTextResponse(payload, media_type=content_type)

    return app
