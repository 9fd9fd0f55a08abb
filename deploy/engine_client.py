"""How the HTTP layer reaches engines: over a Ray Serve handle, or in-process.

`EngineClient` is the seam. `HandleEngineClient` is what the Serve ingress uses: it streams
from `LLMReplica.generate` through `handle.options(stream=True)` and cancels the stream when
the caller stops early. It knows the model without asking a replica (the resolved engine
config and the tokenizer, loaded where the ingress runs), so the model card, /tokenize and
/detokenize never wake a replica of a deployment scaled to zero; a request Serve holds at the
handle (no replica yet, or every one at max_ongoing_requests) waits at most hold_timeout_s
for a replica to take it, then ends in a 503 with Retry-After. `LocalEngineClient` wraps an
in-process `AsyncLLMEngine`; it serves the same FastAPI app without Ray (unit tests,
debugging) and runs the same replica-side code (`stream_engine`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from iterserve.autoscale.signals import ROUTING_STATS_PERIOD_S
from iterserve.deploy.engine_info import (
    describe_engine,
    flat_config,
    lora_adapter_action,
    resolve_model_path,
    stream_engine,
)
from iterserve.deploy.errors import (
    EngineErrorInfo,
    OpenAIHTTPError,
    held_too_long,
    http_error_for,
    unwrap_ray_error,
)
from iterserve.deploy.lora_registry import AdapterRecord, LocalAdapterRegistry
from iterserve.deploy.protocol import ModelInfo, Tokenizer
from iterserve.replica.block_keys import CacheNamespace
from iterserve.replica.config import EngineConfig
from iterserve.replica.lora_adapter import LoRARequest
from iterserve.replica.outputs import RequestOutput
from iterserve.replica.request import TenantShare
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
# How long a request may wait at the handle for a replica to take it (AppArgs.hold_timeout_s).
DEFAULT_HOLD_TIMEOUT_S = 300.0


class EngineClient(Protocol):
    adapters: AdapterRecord  # the cluster's runtime-loaded LoRA adapters

    async def ready(self) -> bool: ...

    async def model_info(self) -> ModelInfo: ...

    async def tokenizer(self) -> Tokenizer: ...

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, cache_namespace: CacheNamespace = b"",
                 lora_request: LoRARequest | None = None, tenant: TenantShare | None = None,
                 ) -> AsyncIterator[RequestOutput]: ...

    async def lora_adapter(self, action: str, name: str, path: str | None = None) -> None:
        """Load or unload an adapter on every replica; OpenAIHTTPError when one refuses."""

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

    def __init__(self, engine: Any, adapters: AdapterRecord | None = None) -> None:
        self.engine = engine
        self.adapters = adapters or LocalAdapterRegistry()

    async def ready(self) -> bool:
        """An in-process engine serves once built, until its loop dies."""
        return bool(self.engine.is_healthy)

    async def model_info(self) -> ModelInfo:
        return model_info_from(describe_engine(self.engine))

    async def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def replica_infos(self) -> list[dict[str, Any]]:
        return [describe_engine(self.engine, {"replica_id": "local"})]

    async def lora_adapter(self, action: str, name: str, path: str | None = None) -> None:
        refused = await lora_adapter_action(self.engine, action, name, path)
        if refused is not None:
            raise refused.to_http()

    async def _still_loaded(self, lora: LoRARequest) -> bool:
        return await self.adapters.is_current(lora.name, lora.version)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, cache_namespace: CacheNamespace = b"",
                       lora_request: LoRARequest | None = None, tenant: TenantShare | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        stream = stream_engine(self.engine, prompt_token_ids, params, request_id, priority,
                               cache_namespace, lora_request, tenant, self._still_loaded)
        try:
            async for item in stream:
                if isinstance(item, EngineErrorInfo):
                    raise item.to_http()
                yield item
        finally:
            await stream.aclose()


class HandleEngineClient:
    """LLMReplica deployments reached through a Serve DeploymentHandle.

    engine: the replicas' EngineConfig, resolved where this ingress runs (the model's files
    are read here too: the tokenizer). scales_to_zero: the deployment may have no replica
    (min_replicas 0), so readiness does not wait for one and nothing here wakes one but a
    generation. hold_timeout_s: how long a generation waits for a replica to take it.
    """

    def __init__(self, handle: Any, engine: EngineConfig, scales_to_zero: bool = False,  # noqa: ANN401
                 hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
                 adapters: AdapterRecord | None = None) -> None:
        if hold_timeout_s <= 0:
            raise ValueError(f"hold_timeout_s must be > 0, got {hold_timeout_s}")
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        self.adapters = adapters or LocalAdapterRegistry()
        self._engine = engine
        self._model_path = resolve_model_path(engine)
        self._scales_to_zero = scales_to_zero
        self._hold_timeout_s = hold_timeout_s
        # What only a replica knows (the KV blocks its profiling found): the last answer.
        self._num_gpu_blocks: int | None = engine.cache.num_gpu_blocks_override
        self._replica_answered = False
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_lock = asyncio.Lock()
        self._warm_up: asyncio.Future[None] | None = None

    def warm_up(self) -> asyncio.Future[None]:
        """Load the tokenizer (and, unless the deployment scales to zero, hear from a replica)
        in the background; one warm-up serves every caller meanwhile."""
        if self._warm_up is None or self._warm_up.done():
            self._warm_up = asyncio.ensure_future(self._warm())
            # Read its failure even when no probe is waiting for it any more.
            self._warm_up.add_done_callback(lambda task: task.cancelled() or task.exception())
        return self._warm_up

    async def _warm(self) -> None:
        await self.tokenizer()
        if not self._scales_to_zero and not self._replica_answered:
            try:
                raw = await self._handle.info.remote()
            except Exception as error:  # noqa: BLE001 - mapped to an HTTP error
                raise http_error_for(error) from error
            self._heard_from(raw)

    def _heard_from(self, info: dict[str, Any]) -> None:
        self._replica_answered = True
        blocks = (info.get("config") or {}).get("num_gpu_blocks")
        if blocks is not None:
            self._num_gpu_blocks = int(blocks)

    async def ready(self) -> bool:
        """Whether a request would be served now. This ingress must hold the tokenizer
        (loaded before the first 200, so the first request does not wait for it: 4.4 s on a
        busy 2-core box for the built-in model), and, with replicas kept (min_replicas >= 1),
        a model replica must have answered (Serve routes nothing to a replica still in its
        constructor; from then on it replaces a failed replica itself and requests retry
        across them). A deployment that scales to zero is ready without a replica: a request
        is held while one starts, and a probe must not start one."""
        if self._tokenizer is not None and (self._scales_to_zero or self._replica_answered):
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self.warm_up()), READY_WAIT_S)
        except (asyncio.TimeoutError, OpenAIHTTPError):
            return False
        except OSError as error:  # the model's tokenizer files: every request would fail
            logger.warning("not ready: the tokenizer did not load: %s", error)
            return False
        return True

    async def model_info(self) -> ModelInfo:
        """The model as the replicas serve it, known here: no replica is asked."""
        engine = self._engine
        tokenizer = await self.tokenizer()
        return ModelInfo(
            model_name=str(engine.served_model_name),
            model_path=self._model_path,
            max_model_len=int(engine.scheduler.max_model_len or 0),
            max_logprobs=engine.max_logprobs,
            vocab_size=getattr(tokenizer, "vocab_size", None),
            config={**flat_config(engine), "num_gpu_blocks": self._num_gpu_blocks},
        )

    async def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            # One load for all the requests that arrive before it ends. Without the lock each
            # cold request loaded its own copy: 4-16 concurrent loads held the first requests
            # 12-17 s on a loaded 2-core box before any reached a replica (RELIABILITY.md §8).
            async with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(load_tokenizer, self._model_path)
        return self._tokenizer

    async def replica_infos(self) -> list[dict[str, Any]]:
        """Every running replica's description (control plane only: a broadcast, which
        reaches the running replicas and starts none; none running: an empty list)."""
        try:
            results = await self._handle.broadcast("info").results_async(
                return_exceptions=True)
        except Exception as error:  # noqa: BLE001 - Serve's "no replica" is an answer here
            if type(unwrap_ray_error(error)).__name__ != "DeploymentUnavailableError":
                raise
            return []
        infos = []
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("a replica did not answer info(): %s", type(result).__name__)
                continue
            self._heard_from(result)
            infos.append(result)
        return infos

    async def lora_adapter(self, action: str, name: str, path: str | None = None) -> None:
        """Broadcast a load or unload to every running replica (a control-plane call; one
        started later reads the adapter when its first request for it carries the path).
        The first refusal is the answer: a 400 for a bad adapter, a 409 while in use."""
        try:
            results = await self._handle.broadcast("lora_adapter", action, name,
                                                   path).results_async(return_exceptions=True)
        except Exception as error:  # noqa: BLE001 - Serve's "no replica" is an answer here
            if type(unwrap_ray_error(error)).__name__ != "DeploymentUnavailableError":
                raise http_error_for(error) from error
            return  # none running: the registry alone holds it until one starts
        for result in results:
            if isinstance(result, BaseException):
                raise http_error_for(result)
            if result is not None and not (action == "unload" and result.status_code == 404):
                raise result.to_http()  # an unload where a replica never had it is done

    async def _until_assigned(self, gen: Any) -> None:  # noqa: ANN401
        """Wait for Serve to give the request to a replica (Ray 2.60: the response's
        replica-result future, which `async for` awaits first; it stays pending while the
        request is held at the handle). Past hold_timeout_s the wait is cancelled, which
        takes the request out of the handle's queue, and the caller gets a 503."""
        try:
            await asyncio.wait_for(gen._fetch_future_result_async(), self._hold_timeout_s)
        except asyncio.TimeoutError:
            raise held_too_long(self._hold_timeout_s) from None

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0, cache_namespace: CacheNamespace = b"",
                       lora_request: LoRARequest | None = None, tenant: TenantShare | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """cache_namespace and lora_request travel as keywords: the KV-aware router reads them
        there (autoscale/router.py) to look the prompt up in the right namespace."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            gen = self._stream_handle.generate.remote(prompt_token_ids, params, request_id,
                                                      priority, cache_namespace=cache_namespace,
                                                      lora_request=lora_request, tenant=tenant)
            complete = False
            started = False
            try:
                await self._until_assigned(gen)
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
