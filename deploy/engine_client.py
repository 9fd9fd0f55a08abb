"""How the HTTP layer reaches engines: over a Ray Serve handle, or in-process.

`EngineClient` is the seam. `HandleEngineClient` is what the Serve ingress uses: it streams
from `LLMReplica.generate` through `handle.options(stream=True)` and cancels the stream when
the caller stops early. `LocalEngineClient` wraps an in-process `AsyncLLMEngine`; it serves
the same FastAPI app without Ray (unit tests, debugging) and runs the same replica-side code
(`stream_engine`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from iterserve.autoscale.signals import ROUTING_STATS_PERIOD_S
from iterserve.deploy.engine_info import describe_engine, stream_engine
from iterserve.deploy.errors import (
    EngineErrorInfo,
    OpenAIHTTPError,
    http_error_for,
    unwrap_ray_error,
)
from iterserve.deploy.protocol import ModelInfo, Tokenizer
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A request whose replica died before it yielded anything is sent once more (Serve routes it
# to a live replica); these are the Ray errors that mean "the replica is gone".
REPLICA_GONE_ERRORS = ("ActorDiedError", "RayActorError", "ActorUnavailableError")
MAX_ATTEMPTS = 3
# A replica that refused a request because it cannot serve (dead engine loop, draining)
# reports so in its next routing stats; waiting one stats period lets the retry avoid it.
RETRY_ELSEWHERE_DELAY_S = ROUTING_STATS_PERIOD_S
# How long /health waits for a model replica's first answer before it says "loading": a
# probe must answer well inside its own timeout (Kubernetes' default is 1 s).
READY_WAIT_S = 0.5


class EngineClient(Protocol):
    async def ready(self) -> bool: ...

    async def model_info(self) -> ModelInfo: ...

    async def tokenizer(self) -> Tokenizer: ...

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 priority: int = 0) -> AsyncIterator[RequestOutput]: ...

    async def replica_infos(self) -> list[dict[str, Any]]: ...


def model_info_from(info: dict[str, Any]) -> ModelInfo:
    return ModelInfo(
        model_name=str(info["model_name"]),
        model_path=info.get("model_path"),
        max_model_len=int(info["max_model_len"]),
        max_logprobs=int(info["max_logprobs"]),
        vocab_size=info.get("vocab_size"),
        config=dict(info.get("config") or {}),
    )


def load_tokenizer(model_path: str | None) -> Tokenizer:
    """The engine's tokenizer, loaded from the model folder (the ingress has no engine)."""
    from iterserve.replica.model_source import resolve_model_path
    from iterserve.replica.tokenizer import Tokenizer as EngineTokenizer

    return EngineTokenizer.from_pretrained(resolve_model_path(model_path))


class LocalEngineClient:
    """An in-process AsyncLLMEngine behind the EngineClient seam."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def ready(self) -> bool:
        """An in-process engine serves once built, until its loop dies."""
        return bool(self.engine.is_healthy)

    async def model_info(self) -> ModelInfo:
        return model_info_from(describe_engine(self.engine))

    async def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def replica_infos(self) -> list[dict[str, Any]]:
        return [describe_engine(self.engine, {"replica_id": "local"})]

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        stream = stream_engine(self.engine, prompt_token_ids, params, request_id, priority)
        try:
            async for item in stream:
                if isinstance(item, EngineErrorInfo):
                    raise item.to_http()
                yield item
        finally:
            await stream.aclose()


class HandleEngineClient:
    """LLMReplica deployments reached through a Serve DeploymentHandle."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        self._info: ModelInfo | None = None
        self._tokenizer: Tokenizer | None = None
        self._lock = asyncio.Lock()
        self._tokenizer_lock = asyncio.Lock()
        self._warm_up: asyncio.Future[Tokenizer] | None = None

    async def ready(self) -> bool:
        """Whether a model replica has answered and this ingress holds the tokenizer. The
        first answer comes only once a replica has loaded its model (Serve routes nothing to
        a replica still in its constructor); from then on Serve replaces a failed replica
        itself and requests retry across them. The tokenizer is loaded here so that the
        first request after a 200 does not wait for it (4.4 s on a busy 2-core box for the
        built-in model). One warm-up serves every probe that asks meanwhile."""
        if self._tokenizer is not None:
            return True
        if self._warm_up is None or self._warm_up.done():
            self._warm_up = asyncio.ensure_future(self.tokenizer())
            # Read its failure even when no probe is waiting for it any more.
            self._warm_up.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            await asyncio.wait_for(asyncio.shield(self._warm_up), READY_WAIT_S)
        except (asyncio.TimeoutError, OpenAIHTTPError):
            return False
        except OSError as error:  # the model's tokenizer files: every request would fail
            logger.warning("not ready: the tokenizer did not load: %s", error)
            return False
        return True

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            async with self._lock:
                if self._info is None:
                    try:
                        raw = await self._handle.info.remote()
                    except Exception as error:  # noqa: BLE001 - mapped to an HTTP error
                        raise http_error_for(error) from error
                    self._info = model_info_from(raw)
        return self._info

    async def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            info = await self.model_info()
            # One load for all the requests that arrive before it ends. Without the lock each
            # cold request loaded its own copy: 4-16 concurrent loads held the first requests
            # 12-17 s on a loaded 2-core box before any reached a replica (RELIABILITY.md §8).
            async with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(load_tokenizer, info.model_path)
        return self._tokenizer

    async def replica_infos(self) -> list[dict[str, Any]]:
        """Every running replica's description (control plane only: a broadcast)."""
        results = await self._handle.broadcast("info").results_async(return_exceptions=True)
        infos = []
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("a replica did not answer info(): %s", type(result).__name__)
                continue
            infos.append(result)
        return infos

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            gen = self._stream_handle.generate.remote(prompt_token_ids, params, request_id,
                                                      priority)
            complete = False
            started = False
            try:
                async for item in gen:
                    if isinstance(item, EngineErrorInfo):
                        complete = True
                        if item.retry_elsewhere and attempt < MAX_ATTEMPTS:
                            break  # nothing started on that replica: send it once more
                        raise item.to_http()
                    started = True
                    yield item
                else:
                    complete = True
                    return
                logger.warning("request %s: its replica cannot serve (%s); retrying (attempt %d)",
                               request_id, item.message, attempt + 1)
                await asyncio.sleep(RETRY_ELSEWHERE_DELAY_S)
            except (OpenAIHTTPError, asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as error:  # noqa: BLE001 - Ray errors become HTTP errors
                complete = True
                if (not started and attempt < MAX_ATTEMPTS
                        and type(unwrap_ray_error(error)).__name__ in REPLICA_GONE_ERRORS):
                    # The replica died before this request produced anything: nothing reached
                    # the client, so send it again; Serve routes it to a live replica.
                    logger.warning("request %s: its replica died before the first token; "
                                   "retrying (attempt %d)", request_id, attempt + 1)
                    continue
                logger.warning("request %s failed in the replica: %s", request_id,
                               type(error).__name__)
                raise http_error_for(error) from error
            finally:
                if not complete:
                    # The caller stopped early (disconnect, error elsewhere): cancel the
                    # replica's generator; Serve injects CancelledError there, which aborts
                    # the request.
                    gen.cancel()
