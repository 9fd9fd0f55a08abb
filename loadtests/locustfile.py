"""Locust users for an OpenAI-compatible streaming API (iterserve or any other server).

Locust's own response time for a streamed request stops at the response headers, which many
servers (a plain Starlette StreamingResponse) send before the first token; iterserve's ingress
waits for the first token, so there the two agree. Either way each request is timed while its
SSE body is read (see `streaming.py`) and reported as extra Locust entries (type METRIC): ``ttft``,
``itl`` (one entry per gap between text chunks, pooled as vLLM does), ``tpot`` and ``e2e``
(response_length = output tokens). The ``POST /v1/completions [headers]`` entry is the
time to headers only. Locust rounds stored times; ``--raw-csv`` keeps exact per-request rows.

Load shapes (``--shape``, or env LOCUST_SHAPE):
  constant  -u users, closed loop (each user sends again as soon as its reply ends)
  step      --step-users more users every --step-time s, up to --step-max-users
  spike     --spike-base-users, jumping to --spike-users at --spike-at s for --spike-duration s
  poisson   open loop: requests start at Poisson times of rate --poisson-rate req/s, shared by
            all users; --poisson-max-users users cap the concurrency (raise it if Locust warns
            the pacer is behind)
Every shape ends at -t/--run-time (or at its natural end: step/spike).

Requests come from the seeded workload (`workload.py`): same --workload-seed, same requests as
`iterserve bench`. Commands (headless, CSV + HTML):

  locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 -u 16 -r 16 -t 60s \
      --csv runs/locust/constant --html runs/locust/constant.html
  LOCUST_SHAPE=step locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 \
      -t 120s --step-users 8 --step-time 20 --step-max-users 64 --csv runs/locust/step \
      --html runs/locust/step.html
  locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 --shape spike \
      -t 60s --spike-users 64 --csv runs/locust/spike --html runs/locust/spike.html
  locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 --shape poisson \
      --poisson-rate 4 --poisson-max-users 64 -t 120s --csv runs/locust/poisson \
      --html runs/locust/poisson.html --raw-csv runs/locust/poisson_requests.csv
"""

from __future__ import annotations

import csv
import itertools
import logging
import random
import threading
import time
from typing import Any

from locust import HttpUser, LoadTestShape, events, task
from locust.env import Environment

from iterserve.autoscale.sim.arrivals import poisson_gaps
from iterserve.autoscale.sim.workload import (
    WorkloadRequest,
    make_workload,
    parse_buckets,
    parse_output_lengths,
)
from iterserve.loadtests.streaming import StreamTiming, completion_body

SHAPES = ("constant", "step", "spike", "poisson")
COMPLETIONS_PATH = "/v1/completions"
logger = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("iterserve")
    group.add_argument("--shape", choices=SHAPES, default="constant", env_var="LOCUST_SHAPE",
                       help="load shape")
    group.add_argument("--model", default="", env_var="LOCUST_MODEL",
                       help="model name (default: the first of GET /v1/models)")
    group.add_argument("--api-key", default="", env_var="OPENAI_API_KEY", help="bearer key")
    group.add_argument("--workload-seed", type=int, default=0, env_var="LOCUST_WORKLOAD_SEED",
                       help="seed of the seeded workload (same seed, same requests as bench)")
    group.add_argument("--workload-size", type=int, default=1024,
                       help="requests generated; users cycle through them")
    group.add_argument("--prompt-buckets", default="short:16-64:0.5,medium:128-384:0.3,"
                       "long:512-1024:0.2", help="name:low-high:weight,...")
    group.add_argument("--output-lengths", default="exponential:128:8-512",
                       help="fixed:N | uniform:LO-HI | exponential:MEAN:LO-HI")
    group.add_argument("--vocab-size", type=int, default=4096,
                       help="prompt token ids are drawn below this")
    group.add_argument("--step-users", type=int, default=4, help="--shape step: users added at each step")
    group.add_argument("--step-time", type=float, default=10.0, help="seconds per step")
    group.add_argument("--step-max-users", type=int, default=32,
                       help="--shape step: the most users it climbs to")
    group.add_argument("--spike-base-users", type=int, default=2,
                       help="--shape spike: users before and after the spike")
    group.add_argument("--spike-users", type=int, default=32,
                       help="--shape spike: users during the spike")
    group.add_argument("--spike-at", type=float, default=10.0,
                       help="--shape spike: seconds into the run when the spike starts")
    group.add_argument("--spike-duration", type=float, default=10.0,
                       help="--shape spike: seconds the spike lasts")
    group.add_argument("--poisson-rate", type=float, default=2.0, help="requests per second")
    group.add_argument("--poisson-max-users", type=int, default=64,
                       help="--shape poisson: users available to send at the Poisson times")
    group.add_argument("--raw-csv", default="", help="write one row per request here")


class _Shared:
    """State shared by all users of this Locust process (gevent: no preemption mid-call)."""

    workload: list[WorkloadRequest] = []
    cursor: Any = itertools.count()
    model: str = ""
    pacer: PoissonPacer | None = None
    raw_rows: list[dict[str, Any]] = []
    lock = threading.Lock()


class PoissonPacer:
    """Global Poisson send times; each user waits for the next free slot."""

    def __init__(self, rate: float, seed: int) -> None:
        self._gaps = poisson_gaps(random.Random(seed), rate)
        self._next = time.monotonic()
        self._warned_at = 0.0

    def delay(self) -> float:
        now = time.monotonic()
        slot = self._next
        self._next = max(self._next, now - 1.0) + next(self._gaps)
        if slot < now - 1.0 and now - self._warned_at > 10:
            self._warned_at = now
            logger.warning("poisson pacer is behind: raise --poisson-max-users")
        return max(0.0, slot - now)


@events.test_start.add_listener
def on_test_start(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    if options is None:
        return
    _Shared.workload = make_workload(
        options.workload_size, options.workload_seed,
        prompt_buckets=parse_buckets(options.prompt_buckets),
        output_lengths=parse_output_lengths(options.output_lengths),
        vocab_size=options.vocab_size)
    _Shared.cursor = itertools.count()
    _Shared.model = options.model
    _Shared.pacer = (PoissonPacer(options.poisson_rate, options.workload_seed)
                     if options.shape == "poisson" else None)


@events.test_stop.add_listener
def on_test_stop(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    if options is None or not options.raw_csv or not _Shared.raw_rows:
        return
    with open(options.raw_csv, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(_Shared.raw_rows[0]))
        writer.writeheader()
        writer.writerows(_Shared.raw_rows)


def _fire(environment: Environment, name: str, seconds: float, length: int = 0) -> None:
    environment.events.request.fire(request_type="METRIC", name=name,
                                    response_time=seconds * 1000.0, response_length=length,
                                    exception=None, context={})


class StreamingCompletionsUser(HttpUser):
    """Sends workload requests to /v1/completions with stream=true and times the stream."""

    def wait_time(self) -> float:
        return _Shared.pacer.delay() if _Shared.pacer is not None else 0.0

    def on_start(self) -> None:
        options = self.environment.parsed_options
        if options is not None and options.api_key:
            self.client.headers["Authorization"] = f"Bearer {options.api_key}"
        if not _Shared.model:
            with self.client.get("/v1/models", name="GET /v1/models",
                                 catch_response=True) as response:
                if response.status_code != 200:
                    response.failure(f"GET /v1/models: HTTP {response.status_code}")
                    return
                _Shared.model = response.json()["data"][0]["id"]

    @task
    def stream_completion(self) -> None:
        if not _Shared.workload:  # started without test_start (e.g. a library run)
            return
        index = next(_Shared.cursor) % len(_Shared.workload)
        request = _Shared.workload[index]
        start = time.perf_counter()
        timing = StreamTiming(start=start)
        with self.client.post(COMPLETIONS_PATH, json=completion_body(request, _Shared.model),
                              stream=True, catch_response=True,
                              name=f"POST {COMPLETIONS_PATH} [headers]") as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            for data in response.iter_content(chunk_size=None):
                timing.feed_bytes(data, time.perf_counter())
            if not timing.ok:
                response.failure(timing.error or "stream ended without a token")
                return
            if timing.output_tokens != request.max_tokens:
                response.failure(f"asked {request.max_tokens} tokens, got {timing.output_tokens}")
                return
        self._report(index, request, timing)

    def _report(self, index: int, request: WorkloadRequest, timing: StreamTiming) -> None:
        if timing.ttft_s is None or timing.e2e_s is None:
            return
        _fire(self.environment, "ttft", timing.ttft_s, timing.output_tokens)
        for gap in timing.chunk_gaps:
            _fire(self.environment, "itl", gap)
        if timing.tpot_s is not None:
            _fire(self.environment, "tpot", timing.tpot_s, timing.output_tokens)
        _fire(self.environment, "e2e", timing.e2e_s, timing.output_tokens)
        options = self.environment.parsed_options
        if options is not None and options.raw_csv:
            _Shared.raw_rows.append({
                "index": index, "prompt_tokens": len(request.prompt_token_ids),
                "output_tokens": timing.output_tokens, "ttft_s": timing.ttft_s,
                "tpot_s": timing.tpot_s, "e2e_s": timing.e2e_s,
                "max_itl_s": max(timing.chunk_gaps, default=0.0)})


class SelectableShape(LoadTestShape):
    """One shape class whose behaviour --shape picks (Locust runs the first shape it finds)."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options if self.runner else None
        if options is None:
            return None
        elapsed = self.get_run_time()
        limit = options.run_time or None
        if limit is not None and elapsed >= limit:
            return None
        if options.shape == "step":
            return _step(options, elapsed, limit)
        if options.shape == "spike":
            return _spike(options, elapsed, limit)
        if options.shape == "poisson":
            users = options.poisson_max_users
            return users, float(users)
        users = options.num_users or 1
        return users, float(options.spawn_rate or users)


def _step(options: Any, elapsed: float, limit: float | None) -> tuple[int, float] | None:
    steps_to_max = -(-options.step_max_users // options.step_users)
    if limit is None and elapsed >= (steps_to_max + 1) * options.step_time:
        return None
    users = min(options.step_max_users, options.step_users * (1 + int(elapsed // options.step_time)))
    return users, float(options.step_users)


def _spike(options: Any, elapsed: float, limit: float | None) -> tuple[int, float] | None:
    spike_end = options.spike_at + options.spike_duration
    if limit is None and elapsed >= spike_end + options.spike_at:
        return None
    in_spike = options.spike_at <= elapsed < spike_end
    users = options.spike_users if in_spike else options.spike_base_users
    return users, float(max(options.spike_users, 1))
