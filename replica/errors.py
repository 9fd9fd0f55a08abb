"""Errors the engine raises to its callers; each maps to one HTTP status at the edge."""

from __future__ import annotations

import torch


class EngineError(Exception):
    """Base class of iterserve engine errors."""


class QueueFullError(EngineError):
    """The waiting queue is at max_waiting_requests; the caller should retry later (429)."""

    def __init__(self, num_waiting: int, retry_after_s: float = 1.0) -> None:
        super().__init__(
            f"the server's waiting queue is full ({num_waiting} requests); retry later"
        )
        self.num_waiting = num_waiting
        self.retry_after_s = retry_after_s


class SLOUnreachableError(EngineError):
    """The request's predicted TTFT exceeds its tenant's ttft_slo_ms: refused at once (429)
    rather than queued to miss its SLO late; retry once the work ahead has drained."""

    def __init__(self, predicted_ms: float, slo_ms: float, retry_after_s: float) -> None:
        super().__init__(
            f"the predicted time to first token ({predicted_ms:.0f} ms) exceeds this tenant's "
            f"ttft_slo_ms ({slo_ms:.0f} ms); retry later")
        self.retry_after_s = retry_after_s


class EngineDrainingError(EngineError):
    """The engine is shutting down and admits no new requests (503)."""


class EngineDeadError(EngineError):
    """The engine loop died; in-flight requests end with this error (500)."""


class RequestFailedError(EngineError):
    """One request failed inside the engine (its batch mates go on); its client gets a 500."""


class DeviceFaultError(EngineError):
    """A fault of the whole step (the device, its memory): the engine loop cannot go on.

    The simulated runner raises it to model a GPU fault in chaos tests.
    """


def is_device_fault(error: BaseException) -> bool:
    """Whether an exception is a fault of the whole step rather than of one request.

    Out-of-memory and CUDA errors leave the device in an unknown state: the loop stops and the
    replica is replaced. Anything else raised while working on one request ends that request.
    """
    if isinstance(error, (DeviceFaultError, MemoryError, torch.OutOfMemoryError)):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and ("CUDA" in message or "device-side" in message)
