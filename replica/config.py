"""Frozen, validated configuration: one dataclass per layer.

Names follow vLLM and TensorRT-LLM so that users' flags carry over (see ARCHITECTURE's table):
max_num_seqs (max_batch_size), max_num_batched_tokens (max_num_tokens), enable_chunked_prefill
(enable_chunked_context), gpu_memory_utilization (kv_cache_free_gpu_memory_fraction), block_size
(tokens_per_block), scheduler_policy, batching. Every check raises ValueError, never assert.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SCHEDULER_POLICIES = ("fcfs", "priority", "guaranteed_no_evict", "max_utilization", "fair")
BATCHING_MODES = ("continuous", "static")
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
RUNNERS = ("model", "simulated")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# The CPU paths (replica/cpu_linear.py, replica/cpu_attention.py), each a setting so that one
# build runs the ablation; "auto" is the fast path on CPU (replica/resolve.py).
CPU_LINEARS = ("auto", "onednn", "torch")
CPU_PREFILL_ATTENTIONS = ("auto", "sdpa", "loop")
CPU_DECODE_ATTENTIONS = ("auto", "blocks", "loop")
CPU_ELEMENTWISE = ("auto", "compiled", "eager")
KV_OFFLOADING_BACKENDS = ("native",)  # vLLM's --kv-offloading-backend; lmcache is not ours
EVICTION_POLICIES = ("lru", "arc", "slru")  # the host KV tier's (replica/host_kv_eviction.py)



def setting(default: Any, help: str, aliases: tuple[str, ...] = (),
            choices: tuple[str, ...] | None = None,
            parse: Callable[[str], Any] | None = None,
            many: bool = False) -> Any:  # noqa: ANN401 - a dataclass field
    """A field that is a user-facing setting: its one declaration. The CLI flag (`--name`),
    its aliases (TensorRT-LLM spellings, as kwargs and flags) and its help come from here;
    `parse` reads the flag's text where the field's type alone cannot (a number or "auto");
    `many`: the flag takes one or more values, as vLLM's list flags do (`--lora-modules a=x
    b=y`), joined by commas into the field."""
    return field(default=default, metadata={"help": help, "aliases": aliases,
                                            "choices": choices, "parse": parse, "many": many})


def gib_or_auto(text: str) -> float | str:
    """A size flag's value: a number of GiB, or "auto"."""
    return text if text == "auto" else float(text)


def offline_cpu_threads() -> int:
    """LLM()'s default: the whole machine is the offline job's."""
    return os.cpu_count() or 1


def replica_cpu_threads() -> int:
    """A Serve replica's default: every core but one, left to the HTTP proxy and ingress."""
    return max(1, (os.cpu_count() or 1) - 1)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry and how many blocks to allocate."""

    block_size: int = setting(16, "tokens per KV block", ("tokens_per_block",))
    gpu_memory_utilization: float = setting(
        0.9, "fraction of GPU memory for weights, activations and the KV cache (profiled)",
        ("kv_cache_free_gpu_memory_fraction",))
    num_gpu_blocks_override: int | None = setting(
        None, "number of KV blocks (skips profiling)")
    # None: sized at start from the memory then free (replica/cpu_memory.py), as vLLM's CPU
    # backend sizes its KV space from the node's memory.
    cpu_kv_cache_bytes: int | None = setting(
        None, "KV cache budget in bytes on CPU (default: gpu_memory_utilization of the memory "
        "free at start, shared among cpu_replicas_per_node, capped at max_num_seqs full-length "
        "requests)")
    cpu_replicas_per_node: int = setting(
        1, "engines sharing this node's memory: their CPU KV caches, the host KV tier's auto "
        "size (the Serve app sets its replica count)")
    enable_prefix_caching: bool = setting(True, "share full prompt blocks between requests")
    # Only 0 is accepted: preemption recomputes (vLLM v1's choice too); the setting exists so
    # that vLLM command lines fail loudly, not silently.
    swap_space: float = setting(0.0, "GiB of host swap for KV blocks (only 0: preemption "
                                "recomputes)")
    # The host KV tier (replica/host_kv_tier.py): off by default, as in vLLM. "auto" is sized
    # where the engine starts, from the node's free memory (host_kv_tier.auto_kv_offloading_gib).
    kv_offloading_size: float | str | None = setting(
        None, "GiB of host memory for a KV tier below the device KV cache: full prefix-cache "
        "blocks evicted from the device are kept there and copied back instead of recomputed; "
        "auto: half the node's free memory shared among cpu_replicas_per_node, at most 64 GiB "
        "(default: off)", parse=gib_or_auto)
    kv_offloading_backend: str = setting(
        "native", "the host KV tier's implementation (only native: iterserve's own)",
        choices=KV_OFFLOADING_BACKENDS)
    # vLLM's CPU offloading spec calls it eviction_policy ("lru" default, "arc"); slru is ours.
    kv_offloading_eviction_policy: str = setting(
        "lru", "which block the host KV tier lets go first: lru (least recently used, vLLM's "
        "default), arc (adaptive between recency and reuse, vLLM's arc), slru (blocks copied "
        "back at least once kept ahead of the rest, in up to 0.8 of the tier)",
        choices=EVICTION_POLICIES)
    # The disk tier below the host tier (replica/disk_kv_tier.py), off by default; LMCache's
    # local_disk / max_local_disk_size. Blocks the host tier evicts are written there.
    kv_offloading_disk_path: str | None = setting(
        None, "folder for a KV tier on local disk below the host tier: blocks the host tier "
        "evicts are written there (asynchronously) and read back instead of recomputed, also "
        "by a replica restarted on the same folder; needs kv_offloading_size (default: off)")
    kv_offloading_disk_size: float = setting(
        16.0, "GiB the disk KV tier may fill under kv_offloading_disk_path (least recently "
        "used blocks are deleted beyond it)")

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
                 f"block_size must be a power of two in [1, 128], got {self.block_size}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                 f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        _require(self.cpu_kv_cache_bytes is None or self.cpu_kv_cache_bytes > 0,
                 "cpu_kv_cache_bytes must be positive")
        _require(self.cpu_replicas_per_node >= 1, "cpu_replicas_per_node must be >= 1")
        _require(self.swap_space == 0,
                 f"swap_space={self.swap_space}: swapping KV blocks to host memory is not "
                 "implemented; preemption recomputes instead. Leave swap_space at 0")
        _require(self.kv_offloading_backend in KV_OFFLOADING_BACKENDS,
                 f"unknown kv_offloading_backend {self.kv_offloading_backend!r}; only "
                 f"{', '.join(KV_OFFLOADING_BACKENDS)} is implemented")
        _require(self.kv_offloading_eviction_policy in EVICTION_POLICIES,
                 f"unknown kv_offloading_eviction_policy {self.kv_offloading_eviction_policy!r}; "
                 f"one of {', '.join(EVICTION_POLICIES)}")
        size = self.kv_offloading_size
        if size is not None:
            _require(size == "auto" or (not isinstance(size, str | bool) and size > 0),
                     f"kv_offloading_size must be > 0 GiB or 'auto', got {size!r}; "
                     "leave it unset to turn the host KV tier off")
            _require(self.enable_prefix_caching,
                     "kv_offloading_size needs enable_prefix_caching: the host KV tier keeps "
                     "prefix-cache blocks under their hash chain")
        if self.kv_offloading_disk_path is not None:
            _require(size is not None,
                     "kv_offloading_disk_path needs kv_offloading_size: the disk tier keeps the "
                     "blocks the host KV tier evicts")
            _require(self.kv_offloading_disk_path != "",
                     "kv_offloading_disk_path must name a folder; leave it unset for no disk tier")
        _require(not isinstance(self.kv_offloading_disk_size, str | bool)
                 and self.kv_offloading_disk_size > 0,
                 f"kv_offloading_disk_size must be > 0 GiB, got {self.kv_offloading_disk_size!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How each iteration's token budget is spent."""

    max_num_seqs: int = setting(256, "most requests in one iteration", ("max_batch_size",))
    max_num_batched_tokens: int | None = setting(
        None, "token budget of one iteration (default: 2048 with chunked prefill, else "
        "max(max_model_len, 2048) so that any prompt fits a step)", ("max_num_tokens",))
    enable_chunked_prefill: bool = setting(True, "split long prompts across iterations",
                                           ("enable_chunked_context",))
    scheduler_policy: str = setting("fcfs", "who is admitted and who is preempted first",
                                    choices=SCHEDULER_POLICIES)
    # fair: when blocks run out, preempt the heaviest tenant's newest request, even for a
    # light tenant's newer one (True); or the newest request whoever's it is (False).
    fair_preempts_heavier: bool = setting(
        True, "under scheduler_policy=fair, a light tenant's request may preempt a heavier "
        "tenant's older one")
    # fair: the step in flight when a light tenant's request arrives is what its first token
    # waits out first; while tenants contend, each one's prompts fill at most its weighted
    # share of a step (replica/prefill_shares.py), so those steps stay short. vLLM's nearest
    # knob, long_prefill_token_threshold, caps every request's chunk, contended or not.
    fair_prefill_share: bool = setting(
        True, "under scheduler_policy=fair with chunked prefill, while tenants of a priority "
        "band have requests waiting or running, each one's prompt tokens in a step are held "
        "to its weighted share of max_num_batched_tokens (a tenant alone takes all of it)")
    batching: str = setting("continuous", "continuous (iteration-level) or static batching",
                            choices=BATCHING_MODES)
    max_model_len: int | None = setting(None, "context length (default: the model's)")
    # Admission window: admit waiting requests every step (0, 0), or only once
    # `admission_min_free_slots` batch slots are free or `admission_max_wait_ms` has passed.
    admission_min_free_slots: int = setting(0, "admit only once this many batch slots are free")
    admission_max_wait_ms: float = setting(0.0, "... or once a request waited this long")
    # SLO-aware admission (replica/slo_admission.py) admits a request only when its predicted
    # TTFT is within this fraction of its tenant's ttft_slo_ms: the rest absorbs the
    # prediction's error, which admitting right up to the objective puts over the line.
    slo_admission_headroom: float = setting(
        0.8, "admit a request with a TTFT objective only when its predicted TTFT is within "
        "this fraction of the objective (0 < f <= 1)")
    max_waiting_requests: int | None = setting(
        None, "bound of the waiting queue; beyond it requests get 429 (default: unbounded)")
    # Static batching keeps finished rows as padding until the batch's longest request ends,
    # as HF generate and FasterTransformer do; False lets them leave at once.
    static_batch_padding: bool = setting(True, "static batching keeps finished rows as padding")

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.scheduler_policy in SCHEDULER_POLICIES,
                 f"unknown scheduler_policy {self.scheduler_policy!r}; "
                 f"choose one of {', '.join(SCHEDULER_POLICIES)}")
        _require(self.batching in BATCHING_MODES,
                 f"unknown batching {self.batching!r}; choose one of {', '.join(BATCHING_MODES)}")
        _require(self.admission_min_free_slots >= 0, "admission_min_free_slots must be >= 0")
        _require(self.admission_max_wait_ms >= 0, "admission_max_wait_ms must be >= 0")
        _require(0 < self.slo_admission_headroom <= 1, "slo_admission_headroom must be in "
                 f"(0, 1], got {self.slo_admission_headroom}")
        _require(self.max_waiting_requests is None or self.max_waiting_requests >= 1,
                 f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        _require(self.max_model_len is None or self.max_model_len >= 1,
                 f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is None or self.max_model_len is None:
            return  # resolved against the model by `resolved`, which validates again
        _require(self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
                 "without chunked prefill a whole prompt must fit one step: "
                 f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                 f"max_model_len ({self.max_model_len}); enable chunked prefill or raise it")

    def resolved(self, model_max_len: int) -> SchedulerConfig:
        """Fill the settings left to the model; a max_model_len above the model's is an error."""
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_max_len}")
        max_len = self.max_model_len or model_max_len
        tokens = self.max_num_batched_tokens
        if tokens is None:
            tokens = 2048 if self.enable_chunked_prefill else max(max_len, 2048)
        return dataclasses.replace(self, max_model_len=max_len, max_num_batched_tokens=tokens)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (one GPU) needs. Build it with `EngineConfig.from_kwargs`."""

    model: str | None = None  # see replica/model_source.py; None means the built-in model
    dtype: str = setting("auto", "weights and activations (auto: bf16 on CUDA, fp32 on CPU)",
                         choices=DTYPES)
    device: str = setting("auto", "auto, cuda or cpu")
    seed: int = setting(0, "engine random seed")
    attention_backend: str = setting("auto", "attention and fused kernels (auto: triton on "
                                     "CUDA, torch on CPU)", choices=ATTENTION_BACKENDS)
    enforce_eager: bool = setting(False, "disable CUDA graphs for decode batches")
    # replica/llm_engine.py; None is resolved (replica/resolve.py) to on exactly when the model
    # runs on CUDA, where the GPU computes step N while the CPU plans step N+1.
    async_scheduling: bool | None = setting(
        None, "plan and prepare step N+1 while the GPU runs step N (default: on with CUDA)")
    runner: str = setting("model", "model, or simulated: the calibrated GPU cost model",
                          choices=RUNNERS)
    simulator: str | None = setting(
        None, "the simulated runner's GPU: h100, h200, a JSON file or inline JSON of "
        "SimulatorConfig / CostModel fields (replica/sim_runner.py)", ("sim_cost_model",))
    load_format: str = setting("auto", "auto: gguf for a .gguf file, else safetensors; dummy: "
                               "random weights from the config (benchmarks)",
                               choices=LOAD_FORMATS)
    served_model_name: str | None = setting(
        None, "model name in the API (default: the model folder or file name)")
    max_logprobs: int = setting(20, "most logprobs a request may ask for")
    # One for an engine embedded in another process; the entry points pass their own: LLM()
    # every core (`offline_cpu_threads`), a Serve replica all but one (`replica_cpu_threads`),
    # leaving a core to the ingress and proxy.
    cpu_threads: int | None = setting(1, "torch intra-op threads on CPU (process-wide; "
                                      "iterserve serve: every core but one)")
    cpu_linear: str = setting("auto", "CPU linears: onednn (weights prepacked once, checked "
                              "against F.linear at start) or torch (F.linear)",
                              choices=CPU_LINEARS)
    cpu_prefill_attention: str = setting("auto", "CPU prefill chunks' attention: sdpa or loop "
                                         "(kernels/reference.py)", choices=CPU_PREFILL_ATTENTIONS)
    cpu_decode_attention: str = setting(
        "auto", "CPU decode attention: blocks (compiled, over (sequence, KV block) pairs, in "
        "place) or loop (kernels/reference.py)", choices=CPU_DECODE_ATTENTIONS)
    cpu_elementwise: str = setting(
        "auto", "CPU RMSNorm, rotary and SiLU*mul: compiled (fused by inductor for prefill-sized "
        "batches) or eager (kernels/reference.py)", choices=CPU_ELEMENTWISE)
    # LoRA (replica/lora_*.py), vLLM's names. Adapters are PEFT folders; each is served as a
    # model name of its own. Off by default: no linear is wrapped, nothing changes.
    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT folders) beside the base "
                                "model, each under its own model name")
    max_loras: int = setting(1, "most distinct LoRA adapters in one batch (the device slots)")
    max_lora_rank: int = setting(16, "largest LoRA rank an adapter may have (slots are padded "
                                 "to it)")
    max_cpu_loras: int | None = setting(None, "LoRA adapters kept read in host memory, LRU "
                                        "(default: max_loras)")
    lora_modules: str | None = setting(None, "adapters served from start: name=path pairs, "
                                       "separated by spaces (as vLLM's flag) or commas",
                                       many=True)
    runtime_lora_root: str | None = setting(
        None, "enables POST /v1/load_lora_adapter and /v1/unload_lora_adapter; loads read only "
        "adapter folders under this directory (unset: the endpoints answer 404)")
    lora_unload_wait_s: float = setting(
        60.0, "seconds POST /v1/unload_lora_adapter waits for requests still using the adapter "
        "to end; past it the answer is 409 and the adapter is served again")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def lora_module_paths(self) -> dict[str, str]:
        """lora_modules as {name: path}, in the order given."""
        if not self.lora_modules:
            return {}
        pairs = [item.strip() for item in self.lora_modules.split(",") if item.strip()]
        return {name.strip(): path.strip()
                for name, path in (pair.split("=", 1) for pair in pairs)}

    def __post_init__(self) -> None:
        self._check_lora()
        _require(self.dtype in DTYPES, f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"unknown attention_backend {self.attention_backend!r}; "
                 f"choose one of {ATTENTION_BACKENDS}")
        _require(self.runner in RUNNERS, f"unknown runner {self.runner!r}; choose one of {RUNNERS}")
        _require(self.load_format in LOAD_FORMATS,
                 f"unknown load_format {self.load_format!r}; choose one of {LOAD_FORMATS}")
        _require(self.max_logprobs >= 0, "max_logprobs must be >= 0")
        _require(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1")
        for name, choices in (("cpu_linear", CPU_LINEARS),
                              ("cpu_prefill_attention", CPU_PREFILL_ATTENTIONS),
                              ("cpu_decode_attention", CPU_DECODE_ATTENTIONS),
                              ("cpu_elementwise", CPU_ELEMENTWISE)):
            _require(getattr(self, name) in choices,
                     f"unknown {name} {getattr(self, name)!r}; choose one of {choices}")

    def _check_lora(self) -> None:
        _require(self.max_loras >= 1, "max_loras must be >= 1")
        _require(self.max_lora_rank >= 1, "max_lora_rank must be >= 1")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 "max_cpu_loras must be >= max_loras")
        _require(not isinstance(self.lora_unload_wait_s, str | bool)
                 and self.lora_unload_wait_s >= 0,
                 f"lora_unload_wait_s must be >= 0 seconds, got {self.lora_unload_wait_s!r}")
        if not self.enable_lora:
            _require(not self.lora_modules and self.runtime_lora_root is None,
                     "lora_modules and runtime_lora_root need enable_lora")
            return
        _require(self.runner == "model", "enable_lora needs runner='model'")
        for pair in (self.lora_modules or "").split(","):
            _require(not pair.strip() or "=" in pair and all(p.strip() for p in pair.split("=", 1)),
                     f"lora_modules entry {pair.strip()!r} is not name=path")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat engine kwargs, accepting TensorRT-LLM aliases.

        >>> EngineConfig.from_kwargs(max_num_seqs=8, block_size=32).cache.block_size
        32
        """
        flat = {}
        for key, value in kwargs.items():
            name = KWARG_ALIASES.get(key, key)
            if name in flat:
                raise ValueError(f"{key!r} and {name!r} name the same setting; pass one")
            flat[name] = value
        groups: dict[str, dict[str, Any]] = {"engine": {}, "cache": {}, "scheduler": {}}
        fields_of = {
            "cache": {f.name for f in dataclasses.fields(CacheConfig)},
            "scheduler": {f.name for f in dataclasses.fields(SchedulerConfig)},
            "engine": {f.name for f in dataclasses.fields(cls)} - {"cache", "scheduler"},
        }
        for name, value in flat.items():
            group = next((g for g, names in fields_of.items() if name in names), None)
            if group is None:
                raise ValueError(f"unknown engine argument {name!r}")
            groups[group][name] = value
        return cls(
            cache=CacheConfig(**groups["cache"]),
            scheduler=SchedulerConfig(**groups["scheduler"]),
            **groups["engine"],
        )


@dataclass(frozen=True)
class SettingSpec:
    """One user-facing engine setting, read from its field's declaration."""

    name: str
    type: Any  # int, float, str or bool (Optional stripped), or the field's parse function
    default: Any
    help: str
    aliases: tuple[str, ...]
    choices: tuple[str, ...] | None
    many: bool = False  # the flag takes one or more values, joined by commas


def engine_settings() -> tuple[SettingSpec, ...]:
    """Every field declared with `setting(...)`, engine fields first, then cache, scheduler."""
    specs = []
    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata:
                continue
            options = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
            kind = f.metadata["parse"] or (options[0] if options else hints[f.name])
            specs.append(SettingSpec(f.name, kind, f.default, f.metadata["help"],
                                     f.metadata["aliases"], f.metadata["choices"],
                                     f.metadata.get("many", False)))
    return tuple(specs)


# TensorRT-LLM spellings accepted as aliases of the vLLM names (declared on the fields).
KWARG_ALIASES = {alias: spec.name for spec in engine_settings() for alias in spec.aliases}
