"""One simulated replica: the production Scheduler and BlockManager on a virtual clock.

A replica is idle or inside one engine step. A step is exactly the engine's
`schedule() -> execute -> update()`, with `SimulatedRunner.batch_shape` and the calibrated
`CostModel` deciding how long it takes, and every sampled token being the request's
`output_token_id`. The cluster calls `advance(now)` whenever something happens to the
replica (a step ends, a request arrives, a stats poll) and `wake_time` says when it must be
called next.

Fast-forward. When every running request is decoding and nothing waits, the next steps
are all alike: n decodes whose KV grows by n tokens a step. Until the first of them
finishes or the free blocks run out (`plan_stretch`), nothing can change that, except a new
request arriving or someone reading the replica's load. So the replica computes those
steps' end times alone (the same float additions as step-by-step) and applies the steps
only when it must (`_materialise`): blocks are taken and registered in the prefix cache in
exactly the per-step order of the production scheduler, so the outcome is identical to
running every step (tests/unit/test_cluster_sim.py checks it byte for byte). A touch in the
middle of a stretch applies the finished steps and turns the step in progress into a real
`schedule()`, which then ends normally.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from iterserve.autoscale.cluster_sim_types import ClusterSimConfig, SimRequest
from iterserve.autoscale.signals import ReplicaLoad
from iterserve.replica.block_manager import BlockManager
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.outputs import RunnerOutput, SchedulerOutput
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.sim_runner import CostModel, SimulatedRunner

MIN_STRETCH_STEPS = 2  # shorter stretches are cheaper to step


def kv_blocks_for(config: ClusterSimConfig) -> int:
    """KV blocks per replica: config.num_blocks, else the simulated GPU's memory budget
    (the formula of `SimulatedRunner.num_kv_blocks` at gpu_memory_utilization 0.9)."""
    if config.num_blocks is not None:
        return config.num_blocks
    sim = config.sim
    budget = sim.gpu_memory_bytes * 0.9 - sim.weights_bytes - sim.activation_reserve_bytes
    blocks = int(budget // (sim.kv_bytes_per_token * config.block_size))
    if blocks < 1:
        raise ValueError("the simulated GPU has no memory left for the KV cache")
    return blocks


@dataclass
class Stretch:
    """Pure-decode steps computed ahead: step s (1-based) ends at end_times[s - 1]."""

    requests: list[Request]  # the running requests, in the scheduler's order
    start_computed: list[int]  # their num_computed_tokens before the stretch
    start_capacity: list[int]  # tokens their block tables held before the stretch
    start_time: float
    end_times: list[float]
    applied: int = 0  # steps already applied to the scheduler

    @property
    def num_steps(self) -> int:
        return len(self.end_times)


class SimReplica:
    def __init__(self, replica_id: str, config: ClusterSimConfig, now: float) -> None:
        self.replica_id = replica_id
        self.config = config
        self.cost: CostModel = config.sim.cost
        self.block_manager = BlockManager(kv_blocks_for(config), config.block_size,
                                          config.enable_prefix_caching)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )
        self.now = now
        self.scheduler = Scheduler(scheduler_config, self.block_manager, clock=self._clock)
        self.step_end: float | None = None  # end of the step in progress (None: idle)
        self._step: SchedulerOutput | None = None
        self._stretch: Stretch | None = None
        self._output_token: dict[str, int] = {}
        self.num_steps = 0
        self.finished: list[Request] = []  # filled by advance(); the caller empties it

    def _clock(self) -> float:
        return self.now

    # ------------------------------------------------------------------------ queries
    @property
    def wake_time(self) -> float | None:
        """When advance() must next be called (None: idle until a request arrives)."""
        if self._stretch is not None:
            return self._stretch.end_times[-1]
        return self.step_end

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.requests)

    def load(self, now: float) -> ReplicaLoad:
        """Its load as record_routing_stats reports it (call advance(now) first)."""
        self._settle(now)
        bm = self.block_manager
        return ReplicaLoad(
            kv_usage=bm.usage,
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_total_blocks,
            step_token_rate=0.0,
            timestamp=now,
        )

    def cached_prefix_tokens(self, token_ids: tuple[int, ...]) -> int:
        """How many leading tokens of a prompt this replica's prefix cache holds now."""
        probe = Request("probe", list(token_ids), SamplingParams(max_tokens=1), 0.0)
        return len(self.block_manager.find_cached_prefix(probe)) * self.block_manager.block_size

    # ----------------------------------------------------------------------- driving
    def add(self, spec: SimRequest, now: float) -> Request:
        """A request arrives (advance(now) first). Raises ValueError if it can never run."""
        self._settle(now)
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
        request = Request(spec.request_id, list(spec.prompt_token_ids), params, now)
        self.scheduler.add_request(request)
        self._output_token[spec.request_id] = spec.output_token_id
        if self.step_end is None:
            self._start_step(now)
        return request

    def advance(self, now: float) -> None:
        """Apply every step that ends at or before now; finished requests go to .finished."""
        while True:
            if self._stretch is not None:
                stretch = self._stretch
                if stretch.end_times[-1] > now:
                    return
                self._materialise(stretch.num_steps)
                self._stretch = None
                self._start_step(stretch.end_times[-1])
                continue
            if self.step_end is None or self.step_end > now:
                return
            self._end_step()

    def _settle(self, now: float) -> None:
        """Make the scheduler's state real at now: apply a stretch's finished steps and
        schedule the one in progress for real."""
        self.advance(now)
        stretch = self._stretch
        if stretch is None:
            return
        done = bisect.bisect_right(stretch.end_times, now)
        self._materialise(done)
        self._stretch = None
        self.now = stretch.end_times[done - 1] if done else stretch.start_time
        output = self.scheduler.schedule()
        self._step = output
        self.step_end = stretch.end_times[done]
        self.num_steps += 1

    # -------------------------------------------------------------------------- steps
    def _start_step(self, now: float) -> None:
        self.now = now
        if not self.scheduler.has_unfinished_requests():
            self.step_end = None
            self._step = None
            return
        if self.config.fast_forward:
            stretch = self.plan_stretch(now)
            if stretch is not None:
                self._stretch = stretch
                self.step_end = None
                self._step = None
                return
        output = self.scheduler.schedule()
        if output.is_empty:  # nothing can run (cannot happen after check_fits) - stay idle
            self.step_end = None
            self._step = None
            return
        self._step = output
        self.step_end = now + self.cost.step_time(*SimulatedRunner.batch_shape(output))
        self.num_steps += 1

    def _end_step(self) -> None:
        output, end = self._step, self.step_end
        self.now = end
        runner_output = RunnerOutput()
        tokens = runner_output.sampled_token_ids
        for scheduled in output.scheduled:
            if scheduled.samples:
                rid = scheduled.request.request_id
                tokens[rid] = self._output_token[rid]
        for request in self.scheduler.update(output, runner_output):
            if request.is_finished:
                self._output_token.pop(request.request_id, None)
                self.finished.append(request)
        self._start_step(end)

    # -------------------------------------------------------------------- fast-forward
    def plan_stretch(self, now: float) -> Stretch | None:
        """The pure-decode steps that can run from now unchanged (None if fewer than
        MIN_STRETCH_STEPS): no waiting request, every running one decoding, none finishing
        and no block shortage before the stretch ends."""
        scheduler = self.scheduler
        if scheduler.num_waiting or scheduler._padding_rows:  # noqa: SLF001 - static batch
            return None
        running = list(scheduler.running)
        n = len(running)
        config = scheduler.config
        if n == 0 or n > config.max_num_batched_tokens or config.batching != "continuous":
            return None
        max_len = config.max_model_len
        steps_left = None
        kv_tokens = 0
        for r in running:
            if r.num_uncomputed_tokens != 1 or r.num_computed_tokens == 0:
                return None
            left = min(r.sampling_params.max_tokens - r.num_output_tokens,
                       max_len - r.num_tokens)
            steps_left = left if steps_left is None else min(steps_left, left)
            kv_tokens += r.num_computed_tokens
        if steps_left - 1 < MIN_STRETCH_STEPS:
            return None
        tables = self.block_manager.block_tables
        block_size = self.block_manager.block_size
        stretch = Stretch(running, [r.num_computed_tokens for r in running],
                          [len(tables[r.request_id]) * block_size for r in running], now, [])
        num_steps = min(steps_left - 1, self._steps_before_block_shortage(stretch, steps_left))
        if num_steps < MIN_STRETCH_STEPS:
            return None
        t = now
        step_time = self.cost.step_time
        end_times = stretch.end_times
        for s in range(1, num_steps + 1):
            t = t + step_time(0, n, kv_tokens + n * s)
            end_times.append(t)
        return stretch

    def _block_events(self, stretch: Stretch, first: int, last: int
                      ) -> list[tuple[int, int, int]]:
        """(step, 0 = take a block / 1 = register a full block, request index) for the
        steps first..last, in the order the per-step scheduler does them."""
        block_size = self.block_manager.block_size
        events = []
        for i, c0 in enumerate(stretch.start_computed):
            # Step s computes position c0 + s - 1: a new block each time it passes the
            # capacity the request had when the stretch began ...
            s = stretch.start_capacity[i] - c0 + 1
            if s < first:
                s += -(-(first - s) // block_size) * block_size
            while s <= last:
                events.append((s, 0, i))
                s += block_size
            # ... and a full block to register when c0 + s reaches a block boundary.
            s = block_size - c0 % block_size
            if s < first:
                s += -(-(first - s) // block_size) * block_size
            while s <= last:
                events.append((s, 1, i))
                s += block_size
        events.sort()
        return events

    def _steps_before_block_shortage(self, stretch: Stretch, horizon: int) -> int:
        free = self.block_manager.num_free_blocks
        taken = 0
        for step, kind, _ in self._block_events(stretch, 1, horizon):
            if kind == 0:
                taken += 1
                if taken > free:
                    return step - 1
        return horizon

    def _materialise(self, upto: int) -> None:
        """Apply steps applied+1..upto of the stretch, exactly as step-by-step would."""
        stretch = self._stretch
        first = stretch.applied + 1
        if upto < first:
            return
        requests, c0 = stretch.requests, stretch.start_computed
        new_times = stretch.end_times[first - 1 : upto]
        num_new = upto - first + 1
        for request in requests:  # each step samples one token per request
            if request.first_token_time is None:  # a prefill chunk left exactly one token
                request.first_token_time = new_times[0]
            request.output_token_ids.extend([self._output_token[request.request_id]] * num_new)
            request.token_times.extend(new_times)
        bm = self.block_manager
        for step, kind, i in self._block_events(stretch, first, upto):
            request = requests[i]
            if kind == 0:  # schedule() of that step: blocks for the token it computes
                request.num_computed_tokens = c0[i] + step - 1
                bm.allocate(request, 1)
            else:  # update() of that step: the block it filled joins the prefix cache
                request.num_computed_tokens = c0[i] + step
                bm.mark_computed(request)
        for i, request in enumerate(requests):
            request.num_computed_tokens = c0[i] + upto
        stretch.applied = upto
        self.num_steps += num_new
        self.now = stretch.end_times[upto - 1]
