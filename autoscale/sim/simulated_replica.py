"""One simulated replica: the production Scheduler and BlockManager on a virtual clock.

A replica is idle or inside one engine step. A step is the engine's `schedule() -> execute
-> update()`, with `SimulatedRunner.batch_shape` and the calibrated `CostModel` deciding how
long it takes and every sampled token being the request's `output_token_id`. The cluster
calls `advance(now)` whenever something happens to the replica (a step ends, a request
arrives, a stats poll); `wake_time` says when it must be called next.

Fast path (config.fast_forward, for the fcfs / continuous / chunked-prefill scheduler).
The decodes of a step need no per-request work except at block boundaries and at their
last token (`sim.decodes.DecodeCohort`), so they are advanced lazily, and the
production scheduler schedules only the rest: the running prefills and the admissions. It
runs on the running list without the decodes and with the budget and the batch slots the
decodes leave (max_num_batched_tokens - n, max_num_seqs - n), which is what its own loop
leaves them after scheduling the n decodes first. Decodes' blocks are taken before, and
registered / freed before the scheduler's update of the rest, in running order, as the
per-step scheduler does. A step in which a preemption could happen (more blocks needed than
free) runs the whole production scheduler instead, with every request brought up to date;
a stats report (`load`) first brings up to date the decodes' computed tokens that the
scheduler's queued-prefill count reads. So the results are identical to stepping everything
(tests/unit/test_cluster_sim.py compares the JSON of both byte for byte).
"""

from __future__ import annotations

import dataclasses
import random
from array import array
from collections.abc import Sequence

from iterserve.autoscale.signals import ReplicaLoad
from iterserve.autoscale.sim.block_manager import tiered_block_manager
from iterserve.autoscale.sim.config import ClusterSimConfig
from iterserve.autoscale.sim.decodes import DecodeCohort, Decoder
from iterserve.autoscale.sim.lora import AdapterResidency
from iterserve.autoscale.sim.prefix import PromptBlockKeys
from iterserve.autoscale.sim.prompts import PackedPrefixes, SyntheticPrompt
from iterserve.autoscale.sim.tenant_admission import TenantAdmission
from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.replica.block_keys import BlockTokens
from iterserve.replica.config import SchedulerConfig
from iterserve.replica.outputs import RunnerOutput, SchedulerOutput
from iterserve.replica.prefill_rate import PrefillRateMeter
from iterserve.replica.request import Request, RequestStatus
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.scheduler import Scheduler
from iterserve.replica.sim_runner import CostModel, SimulatedRunner

# What a step that runs the decodes alone schedules besides them: nothing (never mutated).
_DECODES_ONLY = SchedulerOutput()


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


class VirtualClock:
    """A replica's virtual time, which its scheduler reads. Not a bound method of the
    replica: that would make replica <-> scheduler a reference cycle, which only the cyclic
    collector frees (the simulator pauses it: see sim.state.cyclic_gc_paused)."""

    __slots__ = ("now",)

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class SimulatedReplica:
    def __init__(self, replica_id: str, config: ClusterSimConfig, now: float,
                 prompt_keys: PromptBlockKeys | None = None,
                 packed_prefixes: PackedPrefixes | None = None) -> None:
        """prompt_keys, packed_prefixes: shared by the replicas of one cluster."""
        self.replica_id = replica_id
        self.config = config
        self.cost: CostModel = config.sim.cost
        self.block_manager, self.tier_copies = tiered_block_manager(kv_blocks_for(config),
                                                                    config)
        self.prompt_keys = prompt_keys or PromptBlockKeys(config.block_size)
        self.packed_prefixes = packed_prefixes or PackedPrefixes()
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            scheduler_policy=config.tenancy.engine_policy if config.tenancy else "fcfs",
        )
        # with tenants: each request's tenant fields (the policy's), and SLO admission
        self.admission = None if config.tenancy is None else TenantAdmission(
            config.tenancy, config.dispatch_latency_s + config.stream_latency_s)
        self.clock = VirtualClock(now)
        # with LoRA: its adapters, and the scheduler's max_loras admission rule
        self.adapters = AdapterResidency(config.lora) if config.lora is not None else None
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, clock=self.clock,
                                   max_loras=config.lora.max_loras if config.lora else 0)
        self.decodes = DecodeCohort(self.block_manager, config.max_model_len)
        # Not with LoRA: the lazy path schedules without the decodes in the running list,
        # whose adapters the max_loras rule must count.
        self.lazy = config.fast_forward and self.scheduler_config.scheduler_policy == "fcfs" \
            and self.scheduler_config.batching == "continuous" \
            and self.scheduler_config.enable_chunked_prefill and self.adapters is None
        self.step_end: float | None = None  # end of the step in progress (None: idle)
        self._step: SchedulerOutput | None = None  # what the production scheduler scheduled
        self._step_is_full = True  # the step ran the whole scheduler (no lazy decodes)
        # End time of every step so far, and the requests' token times: C doubles, so that
        # a decode's times are copied from one to the other (and on to the ITL counter) as
        # raw bytes, not converted to and from float objects token by token.
        self._step_ends = array("d")
        self._step_prefill = (0, 0.0)  # prompt tokens and seconds of the step in progress
        self.prefill_rate = PrefillRateMeter()  # the engine's prefill_token_rate meter
        self._seq: dict[str, int] = {}  # running request -> admission order
        self._next_seq = 0
        self._reduced: dict[int, SchedulerConfig] = {}
        self._admitted: list[Request] = []  # admitted by the last lazily scheduled step
        self._prefilling: list[Request] = []  # running, not decodes (scheduler order)
        self._output_token: dict[str, int] = {}
        self._params: dict[int, SamplingParams] = {}
        self.finished: list[Request] = []  # filled by advance(); the caller empties it
        # Copies of its blocks for other replicas' pulls (sim/kv_pull.py), due in its next step
        self.served_pull_seconds = 0.0
        self.engine_waits = config.engine_waits
        # its own stream, so that drawing waits changes nothing else a seed decides
        self._wait_rng = random.Random(f"engine-waits:{config.seed}:{replica_id}")

    @property
    def now(self) -> float:
        return self.clock.now

    @property
    def num_steps(self) -> int:
        return len(self._step_ends)

    @property
    def wake_time(self) -> float | None:
        """When advance() must next be called (None: idle until a request arrives)."""
        return self.step_end

    def load(self, now: float) -> ReplicaLoad:
        """Its load as record_routing_stats reports it (blocks are always exact)."""
        self.advance(now)
        bm = self.block_manager
        if len(self.decodes):  # their computed tokens feed queued_prefill_tokens
            self.decodes.sync_computed(self.num_steps)
        return ReplicaLoad(
            kv_usage=bm.usage,
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_total_blocks,
            step_token_rate=0.0,
            timestamp=now,
            prefill_token_rate=self.prefill_rate.rate(now),
            queued_prefill_tokens=self.scheduler.num_queued_prefill_tokens(),
            lora_adapters=self.adapters.held() if self.adapters is not None else frozenset(),
            lora_running=frozenset(r.lora_name for r in self.scheduler.running
                                   if r.lora_name is not None)
            if self.adapters is not None else frozenset(),
            max_loras=self.scheduler.max_loras,
        )

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of a prompt this replica's prefix cache holds now
        (what find_cached_prefix finds for it)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return 0
        return self.prompt_keys.num_cached_blocks(token_ids, bm.cached_blocks) * bm.block_size

    # ----------------------------------------------------------------------- driving
    def add(self, spec: WorkloadRequest, now: float) -> Request:
        """A request arrives (advance(now) first). Raises ValueError if it can never run."""
        self.advance(now)
        params = self._params.get(spec.max_tokens)
        if params is None:  # frozen: one per max_tokens value (validation is not free)
            params = self._params[spec.max_tokens] = SamplingParams(
                max_tokens=spec.max_tokens, ignore_eos=True)
        prompt = spec.prompt_token_ids
        private = None  # its first private block, marked once it is accepted
        if isinstance(prompt, SyntheticPrompt):
            # It stands in for the list (see its docstring): a list would make ~1k int
            # objects a request, whose churn scatters the heap that the caches' keys live in.
            request = Request(spec.request_id, prompt, params, now,  # type: ignore[arg-type]
                              cache_namespace=prompt.cache_namespace)
            bm = self.block_manager
            if bm.enable_prefix_caching:
                if self.config.lazy_private_blocks:
                    private = prompt.first_private_block(bm.block_size)
                if private is not None:
                    # its own tokens are hashed only after a preemption: not worth packing
                    request.prompt_token_bytes = self.packed_prefixes.prefix_bytes(prompt)
                else:
                    request.prompt_token_bytes = self.packed_prefixes.prompt_bytes(prompt)
        else:
            request = Request(spec.request_id, list(prompt), params, now)
        request.token_times = array("d")  # type: ignore[assignment]
        if self.adapters is not None:
            request.lora_name = spec.adapter
        if self.admission is not None:  # raises SLOUnreachableError: nothing queued
            self.scheduler.check_fits(request)
            self.admission.admit(request, spec.tenant, self.scheduler, now)
        self.scheduler.add_request(request)  # raises if it can never run: nothing marked
        if private is not None:
            self.block_manager.mark_private(spec.request_id, private)
        self._output_token[spec.request_id] = spec.output_token_id
        if self.step_end is None:
            self._start_step(now, continuing=False)
        return request

    def advance(self, now: float) -> None:
        """Run every step that ends at or before now; finished requests go to .finished."""
        while self.step_end is not None and self.step_end <= now:
            end = self.step_end
            self._end_step(end)
            self._start_step(end, continuing=True)

    # ------------------------------------------------------------------------ steps
    def _start_step(self, now: float, continuing: bool) -> None:
        """continuing: it follows the replica's previous step at once (the engine had work
        left), where an engine-CPU wait (config.engine_waits) comes before it."""
        self.clock.now = now
        scheduler = self.scheduler
        if not scheduler.has_unfinished_requests():
            self.step_end = None
            if self.admission is not None:
                self.admission.went_idle()
            return
        step = self.num_steps + 1
        output = self._schedule_lazily(step) if self.lazy and len(self.decodes) else None
        if output is None:
            self._bring_decodes_up_to_date()
            output = scheduler.schedule()
            self._step_is_full = True
            prefill, decode_seqs, kv = SimulatedRunner.batch_shape(output)
        elif output is _DECODES_ONLY:  # the decodes alone: nothing scheduled, none admitted
            self._step, self._step_is_full = output, False
            n = len(self.decodes)
            duration = self.cost.step_time(0, n, self.decodes.kv_tokens_read(step))
            self._finish_starting(now, duration, continuing, n)
            return
        else:
            self._step_is_full = False
            prefill, decode_seqs, kv = SimulatedRunner.batch_shape(output)
            n = len(self.decodes)
            decode_seqs += n
            kv += self.decodes.kv_tokens_read(step)
        self._note_admissions(scheduler.running if self._step_is_full else self._admitted)
        if self._step_is_full and output.is_empty:
            self.step_end = None  # nothing can run (cannot happen after check_fits)
            return
        self._step = output
        num_seqs = len(output.scheduled) + (0 if self._step_is_full else len(self.decodes))
        self._finish_starting(now, self.cost.step_time(prefill, decode_seqs, kv), continuing,
                              num_seqs, prefill)

    def _finish_starting(self, now: float, duration: float, continuing: bool, num_seqs: int,
                         prefill: int = 0) -> None:
        """The step's end: its modelled time, after an engine-CPU wait where one is drawn."""
        if self.engine_waits is not None and continuing:
            duration += self.engine_waits.draw(self._wait_rng.random(), num_seqs)
        if self.tier_copies is not None:  # the step's KV copies run before its forward
            bm = self.block_manager
            duration += self.tier_copies.take_step_seconds(bm, bm.disk_reads, self._step)
            bm.disk_reads = 0
        if self.served_pull_seconds:  # blocks copied out for pulls: the batch runs on after
            duration += self.served_pull_seconds
            self.served_pull_seconds = 0.0
        if self.adapters is not None:  # the adapters the step uses, loaded before its forward
            duration += self.adapters.load_seconds(
                r.lora_name for r in self.scheduler.running if r.lora_name is not None)
        self._step_prefill = (prefill, duration)
        self.step_end = now + duration

    def _schedule_lazily(self, step: int) -> SchedulerOutput | None:
        """schedule() of everything but the decodes, or None if this step must run whole."""
        scheduler, decodes, bm = self.scheduler, self.decodes, self.block_manager
        n = len(decodes)
        config = self.scheduler_config
        if n >= config.max_num_seqs or n >= config.max_num_batched_tokens:
            return None
        allocations = decodes.due_allocs(step)
        rest = self._prefilling  # the running requests that are not decodes, in order
        if len(allocations) + self._blocks_for_prefills(rest, config.max_num_batched_tokens - n) \
                > bm.num_free_blocks:
            return None  # a preemption is possible: the whole scheduler decides
        if allocations:  # each passes its last block by one token: one block each, in order
            bm.append_blocks([member.request.request_id for member in allocations])
        if not rest and not scheduler.num_waiting:
            self._admitted = []
            return _DECODES_ONLY  # schedule() would find nothing to do: skip the call
        everyone, num_rest = scheduler.running, len(rest)
        scheduler.running = rest
        scheduler.config = self._reduced_config(n)
        try:
            output = scheduler.schedule()
        finally:
            scheduler.config = config
            self._admitted = rest[num_rest:]
            scheduler.running = everyone + self._admitted  # admissions join at the end
        if output.preempted:
            raise RuntimeError("a preemption in a lazily scheduled step: the block check "
                               "before it is wrong")
        return output

    def _blocks_for_prefills(self, rest: list[Request], budget: int) -> int:
        """Blocks the running prefills' next chunks take (the scheduler's own loop)."""
        needed = 0
        for request in rest:
            if budget == 0:
                break
            remaining = request.num_uncomputed_tokens
            num_new = remaining if remaining <= budget else budget
            needed += self.block_manager.num_new_blocks_needed(request, num_new)
            budget -= num_new
        return needed

    def _reduced_config(self, n: int) -> SchedulerConfig:
        config = self._reduced.get(n)
        if config is None:
            base = self.scheduler_config
            config = dataclasses.replace(base, max_num_seqs=base.max_num_seqs - n,
                                         max_num_batched_tokens=base.max_num_batched_tokens - n)
            self._reduced[n] = config
        return config

    def _note_admissions(self, candidates: list[Request]) -> None:
        """Give newly running requests their admission order (the running list's order)."""
        for request in candidates:
            if request.request_id not in self._seq:
                self._seq[request.request_id] = self._next_seq
                self._next_seq += 1

    def _bring_decodes_up_to_date(self) -> None:
        step = self.num_steps
        for member in self.decodes.all_members():
            self.decodes.materialise(member, step, self._step_ends)
        self.decodes.clear()

    def _end_step(self, end: float) -> None:
        self.clock.now = end
        self._step_ends.append(end)
        output = self._step
        if output is _DECODES_ONLY:  # no prompt tokens (no rate sample), nothing to update
            self._update_decodes(len(self._step_ends))
            return
        self.prefill_rate.record(end, *self._step_prefill)
        if self.admission is not None:
            prefill, seconds = self._step_prefill
            self.admission.step_ended(end - seconds, end, prefill)
        step = self.num_steps
        if not self._step_is_full:
            self._update_decodes(step)
        if output.scheduled:
            runner_output = RunnerOutput()
            tokens = runner_output.sampled_token_ids
            for scheduled in output.scheduled:
                if scheduled.samples:
                    rid = scheduled.request.request_id
                    tokens[rid] = self._output_token[rid]
            for request in self.scheduler.update(output, runner_output):
                if request.is_finished:
                    self._forget(request)
            for request in output.preempted:
                self._seq.pop(request.request_id, None)
        elif not self._step_is_full:
            return  # only decodes ran: nothing can have joined them
        if self.lazy:
            running = self.scheduler.running
            self._join_decodes(step, running if self._step_is_full
                               else [s.request for s in output.scheduled])
            members = self.decodes.members
            self._prefilling = [r for r in (running if self._step_is_full else self._prefilling)
                                if r.status == RequestStatus.RUNNING
                                and r.request_id not in members]

    def _update_decodes(self, step: int) -> None:
        """The step's REGISTERs (admission order), then its FINISHes (admission order): the
        order of the per-step update, where a finish frees only its own blocks and a
        registration touches only the registering request's own newest block."""
        decodes = self.decodes
        registers = decodes.due_registers(step)
        if registers:
            self._register_decode_blocks(registers, step)
        for member in decodes.due_finishes(step):
            request = member.request
            decodes.leave(request.request_id, step)
            decodes.materialise(member, step, self._step_ends)
            self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
            self._forget(request)

    def _register_decode_blocks(self, members: list[Decoder], step: int) -> None:
        """The blocks these members just filled join the prefix cache, in order. A block of
        output tokens is a run of the member's token (every sampled token of a simulated
        request is its output_token_id): registered without materialising the request's
        tokens; one that still holds prompt tokens, or that the block manager declines,
        takes the general path (materialise, mark_computed) in its turn."""
        bm = self.block_manager
        size = bm.block_size
        runs: list[Request] = []
        tokens: list[BlockTokens] = []
        waiting: list[Decoder] = []  # the members of runs, not yet registered
        for member in members:
            request = member.request
            computed = member.computed0 + step - member.join_step
            request.num_computed_tokens = computed
            if computed - size >= member.prompt_len:
                runs.append(request)
                tokens.append(member.run)
                waiting.append(member)
            else:
                self._register_runs(runs, tokens, waiting, step)
                runs, tokens, waiting = [], [], []
                self.decodes.materialise(member, step)
                bm.mark_computed(request)
        self._register_runs(runs, tokens, waiting, step)

    def _register_runs(self, runs: list[Request], tokens: list[BlockTokens],
                       members: list[Decoder], step: int) -> None:
        bm, i = self.block_manager, 0
        while i < len(runs):
            i = bm.register_output_blocks(runs, tokens, i)
            if i < len(runs):  # declined: the general path, in its turn
                self.decodes.materialise(members[i], step)
                bm.mark_computed(runs[i])
                i += 1

    def _join_decodes(self, step: int, candidates: list[Request]) -> None:
        """Running requests the step left with one token to compute become decodes."""
        decodes = self.decodes
        for request in candidates:
            rid = request.request_id
            if rid not in decodes and request.status == RequestStatus.RUNNING \
                    and request.num_uncomputed_tokens == 1 and request.num_computed_tokens > 0:
                decodes.join(request, self._seq[rid], step, self._output_token[rid],
                             self.block_manager.private_from.get(rid))

    def _forget(self, request: Request) -> None:
        self._output_token.pop(request.request_id, None)
        self._seq.pop(request.request_id, None)
        self.finished.append(request)
