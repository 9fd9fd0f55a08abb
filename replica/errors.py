"""Errors the engine raises to its callers; each maps to one HTTP status at the edge."""

from __future__ import annotations


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


class EngineDrainingError(EngineError):
    """The engine is shutting down and admits no new requests (503)."""


class EngineDeadError(EngineError):
    """The engine loop died; in-flight requests end with this error (500)."""


class StructuredOutputError(EngineError, ValueError):
    """A request's grammar or logit controls left no token to sample, or its grammar failed
    to compile; only that request ends (400: the cause is the request's own constraint)."""
