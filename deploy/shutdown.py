"""How `iterserve serve` stops: SIGTERM or SIGINT drains, a second signal stops at once.

    first signal    (once the app is being deployed) every ingress stops admitting: /health
                    and the API routes answer 503, so load balancers and readiness probes
                    take the server out, while /live and /metrics still answer; the requests
                    in flight run to their end, for up to the drain timeout; the replicas
                    then end the rest, whose clients read a 503 error ("... the drain
                    timeout ...") instead of a cut connection
    second signal   stop now: no drain, the streams still open are cut
    before deploy   a signal stops at once (nothing can have been admitted)

A signal while `serve.run` deploys the app interrupts it and drains too: /v1/models and
/health may answer before `serve.run` returns, so requests may be in flight already.

Ray replaces the handlers a driver installs before `ray.init`: worker.py sets a SIGTERM
handler (`sys.exit`), the head node it starts sets another (drain the node, kill its
processes, exit 1), and the core worker that `ray.init` creates installs absl's failure
signal handler for SIGTERM in C, which prints "*** SIGTERM received at time=..." and a stack
and ends the process by abort (exit 134) with every stream cut. `StopSignals.install` is
therefore called again after `ray.init`: a Python `signal.signal` call sets the C-level
handler anew, so ours is the one that runs.

A server started by another program (`iterserve bench`, the experiments, the test helpers:
loadtests/servers.py) also ends when that program dies, however it dies: `exit_with_parent`
asks Linux for a SIGTERM then (PR_SET_PDEATHSIG), which drains and stops as above.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

logger = logging.getLogger("iterserve.serve")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_WITH_PARENT_ENV = "ITERSERVE_EXIT_WITH_PARENT"  # the starter's pid
PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 0.1
BROADCAST_TIMEOUT_S = 10.0
# After the replicas end the streams left at the drain timeout, the time their error events
# and [DONE] take to reach the clients (a retry of a request not yet started takes ~1 s).
END_WAIT_S = 10.0


class StopNow(KeyboardInterrupt):
    """Stop without draining: a second signal, or a first one before the app is deployed."""


class DrainNow(KeyboardInterrupt):
    """A first signal while `serve.run` deploys the app: stop deploying, then drain."""


class StopSignals:
    """SIGINT and SIGTERM in the main thread. The first signal once `drainable` asks for a
    drain: `wait` returns its name, or DrainNow interrupts whatever runs (serve.run); any
    other signal raises StopNow, wherever the main thread is, and later ones are ignored."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.drainable = False
        self._waiting = False
        self._stopping_now = False

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._stopping_now:  # already stopping as fast as it can
            return
        name = signal.Signals(signum).name
        if self.received is None and self.drainable:
            self.received = name
            if not self._waiting:
                raise DrainNow(name)
            return
        self.received = self.received or name
        self._stopping_now = True
        raise StopNow(name)

    def ignore(self) -> None:
        """From now on signals change nothing: what runs is the fastest stop there is."""
        self._stopping_now = True

    def wait(self) -> str:
        """Block until the first signal; its name."""
        self._waiting = True
        while self.received is None:
            time.sleep(0.5)  # a signal's handler runs during the sleep; the loop sees it
        return self.received


def exit_with_parent() -> None:
    """Where EXIT_WITH_PARENT_ENV names this process's parent, have the kernel send SIGTERM
    when the parent dies (a SIGKILL or the OOM killer included, which no handler of the
    parent's can catch). Linux sends it when the parent's *thread* that started us ends, so
    a starter must start servers from a thread that lives as long as they should."""
    parent = os.environ.pop(EXIT_WITH_PARENT_ENV, None)  # Ray's processes need not see it
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        logger.warning("cannot end with the parent process (prctl errno %d)", ctypes.get_errno())
        return
    if os.getppid() != int(parent):  # it died before the prctl call: nobody will signal us
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class DrainReport:
    """in_flight: API requests in flight when the drain began; cut: those still running at
    the drain timeout, ended with a 503 error; seconds: how long the drain took."""

    in_flight: int
    cut: int
    seconds: float
    timeout_s: float

    def line(self, signal_name: str) -> str:
        if self.in_flight == 0:
            return f"iterserve: {signal_name}: no request in flight; stopped"
        finished = self.in_flight - self.cut
        text = (f"iterserve: {signal_name}: drained {self.in_flight} request(s) in "
                f"{self.seconds:.1f} s: {finished} finished")
        if self.cut:
            text += (f", {self.cut} ended with a 503 error at the drain timeout "
                     f"({self.timeout_s:g} s)")
        return text + "; stopped"


def drain_app(app_name: str, timeout_s: float, signal_name: str) -> DrainReport:
    """Stop every ingress admitting, wait up to timeout_s for its requests in flight, then
    end the rest in the replicas (see the module docstring)."""
    from ray import serve

    from iterserve.deploy.ingress import OpenAIIngress
    from iterserve.deploy.llm_replica import LLMReplica

    started = time.monotonic()
    try:
        ingress = serve.get_deployment_handle(OpenAIIngress.name, app_name)
    except KeyError:  # a signal came before serve.run had created the app: nothing to drain
        return DrainReport(0, 0, time.monotonic() - started, timeout_s)
    in_flight = _sum(ingress.broadcast("begin_drain"))
    if in_flight:
        print(f"iterserve: {signal_name}: draining {in_flight} request(s), for up to "
              f"{timeout_s:g} s (a second signal stops at once)", flush=True)
    remaining = _wait_for_zero(ingress, started + timeout_s, in_flight)
    if remaining:
        replicas = serve.get_deployment_handle(LLMReplica.name, app_name)
        message = (f"The server is shutting down: this request was still running when the "
                   f"drain timeout ({timeout_s:g} s) ended it.")
        _sum(replicas.broadcast("end_streams", message))
        _wait_for_zero(ingress, time.monotonic() + END_WAIT_S, remaining)
    return DrainReport(in_flight, remaining, time.monotonic() - started, timeout_s)


def _wait_for_zero(ingress: Any, deadline: float, count: int) -> int:  # noqa: ANN401
    while count and time.monotonic() < deadline:
        time.sleep(POLL_S)
        count = _sum(ingress.broadcast("in_flight"))
    return count


def _sum(response: Any) -> int:  # noqa: ANN401 - a Serve DeploymentBroadcastResponse
    """The sum of every replica's answer; a replica that does not answer counts 0 (gone)."""
    from ray.serve.exceptions import RayServeException

    try:
        results = response.results(timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
    except RayServeException:  # no replica running (DeploymentUnavailableError)
        return 0
    except TimeoutError:
        logger.warning("the replicas did not answer within %.0f s during the drain",
                       BROADCAST_TIMEOUT_S)
        return 0
    total = 0
    for result in results:
        if isinstance(result, BaseException):
            logger.warning("a replica did not answer during the drain: %s",
                           type(result).__name__)
            continue
        total += int(result)
    return total
