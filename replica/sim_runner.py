"""`SimulatedRunner`: the Runner protocol on a calibrated cost model, without a GPU.

One step sleeps for

    step_time = a + b * prefill_tokens + c * decode_seqs + d * kv_tokens_read

and then samples one seeded token per request that samples. Everything above the runner
(scheduler, block manager, engines, replica, router, autoscaler) is the production code, so
router and autoscaler experiments run eight "GPUs" on a 2-core laptop: a step costs
microseconds of CPU (a few integer hashes per request) and the rest is `time.sleep`.

Default coefficients: Llama-3-8B (bf16) on one H100 SXM 80GB, vLLM-class engine. Each is
derived from published figures next to it; measured coefficients replace them through
`CostModel.fit(...)` (least squares over measured steps), `CostModel.from_json(path)`, or the
engine setting `simulator` (`--simulator`: a preset name, a JSON file path or an inline JSON
object of CostModel / SimulatorConfig fields, optionally {"preset": "h200"}), read once, in
the constructor. `SimulatorConfig.preset("h200")` gives H200 SXM 141GB figures.

Tokens: token at output position p of a request is hash(seed, p) mod vocab_size, where
seed is SamplingParams.seed (mixed with the child index) if set, else a stable hash of
the prompt tokens for greedy requests (same prompt, same output, like real greedy
decoding) or of the request id otherwise. Position-keyed, so a preempted request
recomputes the same tokens and batch mates never matter. EOS ids and stop_token_ids are
never emitted unless SimulatorConfig.eos_probability > 0.

`device_idle` (a `DeviceIdleMeter`) counts how long the simulated GPU waited for the engine
between steps that carry a batch on: the engine CPU time the cost model leaves out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from iterserve.replica.config import EngineConfig
from iterserve.replica.device_idle import DeviceIdleMeter
from iterserve.replica.errors import DeviceFaultError, is_device_fault
from iterserve.replica.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from iterserve.replica.runner_base import CompletedStep, StepHandle

GiB = 1024**3
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class CostModel:
    """Seconds per engine step; see module docstring for the formula."""

    # a: fixed per-step cost. A decode step must stream all weights once: 16.06 GB of bf16
    # Llama-3-8B weights (8.03e9 params x 2 B, Meta model card) / 3.35 TB/s (H100 SXM HBM3,
    # NVIDIA H100 datasheet) = 4.8 ms at 100 % bandwidth; ~75 % achievable bandwidth plus
    # launch/scheduling overhead gives the ~6.5-7 ms single-sequence decode (TPOT at batch 1)
    # reported for 8B models on H100 in vLLM / TensorRT-LLM benchmark posts.
    a_s: float = 6.5e-3
    # b: per prefill token. Forward pass = 2 x 8.03e9 FLOPs/token = 16 GFLOP; H100 SXM dense
    # BF16 peak 989 TFLOPS (datasheet) at ~55 % MFU for large prefill GEMMs -> 2.95e-5 s,
    # i.e. ~34k prompt tokens/s, in line with published vLLM prefill throughput for 8B/H100.
    b_s_per_prefill_token: float = 3.0e-5
    # c: per decoding sequence. The same 16 GFLOP/token at lower (~45 %) MFU for skinny
    # decode GEMMs (3.6e-5 s) plus ~4 us of sampling / bookkeeping per sequence.
    c_s_per_decode_seq: float = 4.0e-5
    # d: per KV token read by attention. Llama-3-8B KV = 2 (K,V) x 32 layers x 8 KV heads x
    # 128 dims x 2 B = 131072 B/token (model config.json); at ~2.3 TB/s effective (70 % of
    # 3.35 TB/s, typical of paged-attention decode kernels) -> 5.7e-8 s/token.
    d_s_per_kv_token: float = 5.7e-8

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")

    def step_time(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        return (
            self.a_s
            + self.b_s_per_prefill_token * prefill_tokens
            + self.c_s_per_decode_seq * decode_seqs
            + self.d_s_per_kv_token * kv_tokens_read
        )

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, int, float]]) -> CostModel:
        """Least-squares coefficients from measured steps
        (prefill_tokens, decode_seqs, kv_tokens_read, step_time_s); negatives clip to 0."""
        if len(samples) < 4:
            raise ValueError(f"need at least 4 measured steps to fit 4 coefficients, "
                             f"got {len(samples)}")
        import numpy as np

        x = np.array([[1.0, p, s, k] for p, s, k, _ in samples], dtype=np.float64)
        y = np.array([t for *_, t in samples], dtype=np.float64)
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        a, b, c, d = (max(0.0, float(v)) for v in coef)
        return cls(a, b, c, d)


@dataclass(frozen=True)
class SimulatorConfig:
    """The simulated GPU: its cost model, memory budget and token stream."""

    cost: CostModel = field(default_factory=CostModel)
    gpu_memory_bytes: int = 80 * 10**9  # H100 SXM 80GB (datasheet)
    weights_bytes: int = 16 * 10**9  # Llama-3-8B bf16, 8.03e9 params x 2 B
    activation_reserve_bytes: int = 2 * 10**9  # profiling-pass peak beyond weights (approx.)
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2  # Llama-3-8B: 128 KiB / token
    time_scale: float = 1.0  # >1 slows the simulated GPU (experiments on small CPUs)
    eos_probability: float = 0.0  # per sampled token; 0 never ends a request on EOS
    sleep: bool = True  # False: account time without sleeping (unit tests)
    # Chaos: when this file exists at the start of a step, the first replica to claim it
    # (by deleting it) faults as a GPU would (DeviceFaultError), which stops its engine loop.
    fault_trigger_file: str | None = None

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError(f"eos_probability must be in [0, 1], got {self.eos_probability}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError("kv_bytes_per_token must be > 0")

    @classmethod
    def preset(cls, name: str) -> SimulatorConfig:
        """'h100' (default: H100 SXM 80GB) or 'h200' (H200 SXM 141GB), Llama-3-8B bf16."""
        if name == "h100":
            return cls()
        if name == "h200":
            # H200 SXM: 141 GB HBM3e at 4.8 TB/s, same Hopper compute (NVIDIA H200 datasheet).
            # a: 16.06 GB / 4.8 TB/s = 3.3 ms at peak, /0.75 + ~1 ms overhead -> 5.5 ms.
            # d: 131072 B / (0.7 x 4.8 TB/s) = 3.9e-8 s per KV token. b, c: as H100 (compute).
            return cls(cost=CostModel(a_s=5.5e-3, d_s_per_kv_token=3.9e-8),
                       gpu_memory_bytes=141 * 10**9)
        raise ValueError(f"unknown simulator preset {name!r}; choose h100 or h200")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SimulatorConfig:
        """CostModel fields and SimulatorConfig fields in one flat or nested mapping, on top
        of an optional "preset" ("h100" or "h200")."""
        data = dict(data)
        base = cls.preset(str(data.pop("preset", "h100")))
        cost_fields = {f.name for f in dataclasses.fields(CostModel)}
        cost_kwargs = dict(data.pop("cost", {}))
        cost_kwargs.update({k: data.pop(k) for k in list(data) if k in cost_fields})
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown simulator settings: {sorted(unknown)}")
        cost = dataclasses.replace(base.cost, **cost_kwargs)
        return dataclasses.replace(base, cost=cost, **data)

    @classmethod
    def from_spec(cls, spec: str | None) -> SimulatorConfig:
        """EngineConfig.simulator: None (defaults), a preset name (h100, h200), inline JSON or
        the path of a JSON file, as `from_mapping` reads them."""
        if spec is None or not spec.strip():
            return cls()
        spec = spec.strip()
        if spec in ("h100", "h200"):
            return cls.preset(spec)
        text = spec if spec.startswith("{") else Path(spec).read_text()
        return cls.from_mapping(json.loads(text))


def _claim(path: str) -> bool:
    """Delete path if it exists; True for the one caller whose delete succeeded."""
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    return True


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sim_token(seed: int, position: int, vocab_size: int, banned: frozenset[int]) -> int:
    """The deterministic token at `position` of the stream `seed`, avoiding `banned`."""
    h = _mix64(seed ^ (position * 0xD1B54A32D192ED03 & _MASK64))
    token = h % vocab_size
    while token in banned:
        h = _mix64(h)
        token = h % vocab_size
    return token


def seeded_stream(sampling_seed: int, child_index: int = 0) -> int:
    """The token stream of a request with SamplingParams.seed = sampling_seed (child
    `child_index` when n > 1)."""
    return _mix64((sampling_seed & _MASK64) ^ (child_index + 1))


def sim_output_tokens(sampling_seed: int, count: int, vocab_size: int,
                      banned: frozenset[int] = frozenset(), child_index: int = 0) -> list[int]:
    """The first `count` tokens the simulated runner samples for a request with
    SamplingParams.seed = sampling_seed (eos_probability 0): what a replayed chat's next
    turn must hold of this turn's answer for the prefix cache to find it. `banned`: the
    request's EOS and stop token ids inside the vocabulary."""
    stream = seeded_stream(sampling_seed, child_index)
    return [sim_token(stream, p, vocab_size, banned) for p in range(count)]


class SimulatedRunner:
    """Runner protocol: num_kv_blocks(), execute(SchedulerOutput), release(request_id)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        vocab_size: int,
        sim_config: SimulatorConfig | None = None,
        sleep_fn: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.engine_config = engine_config
        self.vocab_size = vocab_size
        self.sim = (sim_config if sim_config is not None
                    else SimulatorConfig.from_spec(engine_config.simulator))
        self._sleep = sleep_fn
        self._clock = clock
        self._seeds: dict[str, int] = {}
        self._banned: dict[str, frozenset[int]] = {}
        self.total_simulated_s = 0.0  # sum of modelled step times (before time_scale)
        self.num_steps = 0
        self._busy_until = 0.0  # when the last launched step ends on the simulated GPU
        self.device_idle = DeviceIdleMeter()  # the engine's CPU time the GPU waited for
        self._previous_batch: set[str] = set()

    # ---------------------------------------------------------------------------- memory
    @property
    def kv_bytes_per_block(self) -> int:
        return self.sim.kv_bytes_per_token * self.engine_config.cache.block_size

    def num_kv_blocks(self) -> int:
        """num_gpu_blocks_override if set, else the simulated GPU's KV byte budget / block."""
        cache = self.engine_config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        budget = (
            self.sim.gpu_memory_bytes * cache.gpu_memory_utilization
            - self.sim.weights_bytes
            - self.sim.activation_reserve_bytes
        )
        blocks = int(budget // self.kv_bytes_per_block)
        if blocks < 1:
            raise ValueError(
                f"no simulated GPU memory left for the KV cache: {self.sim.gpu_memory_bytes} B "
                f"x {cache.gpu_memory_utilization} minus weights and activations"
            )
        return blocks

    # --------------------------------------------------------------------------- compute
    @staticmethod
    def batch_shape(scheduler_output: SchedulerOutput) -> tuple[int, int, int]:
        """(prefill_tokens, decode_seqs, kv_tokens_read) of one step."""
        prefill_tokens = 0
        decode_seqs = 0
        kv_tokens = 0
        for s in scheduler_output.scheduled:
            if s.is_decode:
                decode_seqs += 1
            else:
                prefill_tokens += s.num_new_tokens
            kv_tokens += s.num_computed_tokens + s.num_new_tokens
        return prefill_tokens, decode_seqs, kv_tokens

    def step_time(self, scheduler_output: SchedulerOutput) -> float:
        return self.sim.cost.step_time(*self.batch_shape(scheduler_output))

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.launch(scheduler_output).result()

    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Sample at once (microseconds of CPU) and return a step that completes when the
        simulated GPU would: the modelled time after the later of now and the end of the
        step before it, as kernels queue on one CUDA stream. Whatever the engine does on the
        CPU before calling result() hides behind that time."""
        start = self._clock()
        output = RunnerOutput()
        if scheduler_output.is_empty:
            return CompletedStep(output)
        if self.sim.fault_trigger_file is not None and _claim(self.sim.fault_trigger_file):
            raise DeviceFaultError("simulated GPU fault (chaos trigger file)")
        modelled = self.step_time(scheduler_output)
        for s in scheduler_output.scheduled:
            if s.samples:
                self._sample_into(output, s)
        self.total_simulated_s += modelled
        self.num_steps += 1
        if not self.sim.sleep:
            return CompletedStep(output)
        batch = {s.request.request_id for s in scheduler_output.scheduled}
        if not batch.isdisjoint(self._previous_batch):  # the engine stepped on at once
            self.device_idle.record(len(batch), max(0.0, start - self._busy_until))
        self._previous_batch = batch
        # The step starts after our own (tiny) CPU time, or when the previous step ends.
        done_at = max(start, self._busy_until) + modelled * self.sim.time_scale
        self._busy_until = done_at
        return SimulatedStep(output, done_at, self._clock, self._sleep)

    def _sample_into(self, output: RunnerOutput, s: ScheduledRequest) -> None:
        """One request's token; a failure ends that request alone (the engine reads errors)."""
        request_id = s.request.request_id
        try:
            output.sampled_token_ids[request_id] = self._sample(s)
        except Exception as error:  # noqa: BLE001 - reported per request; device faults raise
            if is_device_fault(error):
                raise
            output.failed[request_id] = f"{type(error).__name__}: {error}"

    def release(self, request_id: str) -> None:
        self._seeds.pop(request_id, None)
        self._banned.pop(request_id, None)

    # -------------------------------------------------------------------------- sampling
    def _seed_for(self, s: ScheduledRequest) -> int:
        rid = s.request.request_id
        seed = self._seeds.get(rid)
        if seed is None:
            params = s.request.sampling_params
            if params.seed is not None:
                seed = seeded_stream(params.seed, s.request.index)
            elif params.is_greedy:
                prompt = s.request.prompt_token_ids
                seed = _mix64(zlib.crc32(b"".join(t.to_bytes(4, "little") for t in prompt)))
            else:
                seed = _mix64(zlib.crc32(rid.encode()))
            self._seeds[rid] = seed
            banned = set(s.request.eos_token_ids) | set(params.stop_token_ids)
            banned |= set(params.extra_eos_token_ids)
            self._banned[rid] = frozenset(t for t in banned if 0 <= t < self.vocab_size)
        return seed

    def _sample(self, s: ScheduledRequest) -> int:
        seed = self._seed_for(s)
        position = s.sample_position  # index of the token being sampled
        request = s.request
        banned = self._banned[request.request_id]
        if (
            self.sim.eos_probability > 0
            and banned
            and not request.sampling_params.ignore_eos
            and request.eos_token_ids
        ):
            u = _mix64(seed ^ ~position & _MASK64) / float(_MASK64)
            if u < self.sim.eos_probability:
                return min(request.eos_token_ids)
        if len(banned) >= self.vocab_size:
            raise ValueError("every token id is an EOS or stop token; cannot sample")
        return sim_token(seed, position, self.vocab_size, banned)


class SimulatedStep:
    """A launched simulated step: its output is ready at `done_at` on the runner's clock."""

    def __init__(self, output: RunnerOutput, done_at: float, clock: Callable[[], float],
                 sleep: Callable[[float], None]) -> None:
        self._output = output
        self.done_at = done_at
        self._clock = clock
        self._sleep = sleep

    def result(self) -> RunnerOutput:
        remaining = self.done_at - self._clock()
        if remaining > 0:
            self._sleep(remaining)
        return self._output
