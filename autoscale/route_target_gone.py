"""The error a call naming one replica (the router's route_to_replica) gets while that
replica is not running.

Its own module, not the router's: Serve ships the router class to each handle's process
pickled by value (its module re-created there), so a class defined beside it would not be
the one the caller catches; this module is imported by reference on both sides."""

from __future__ import annotations

from ray.serve.exceptions import RayServeException


class RouteTargetGone(RayServeException):
    """A call's route_to_replica names no live replica (it died, drained, or never was)."""

    def __init__(self, target: str) -> None:
        super().__init__(f"replica {target!r} named by route_to_replica is not running")
        self.target = target
