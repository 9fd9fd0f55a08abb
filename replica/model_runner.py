"""The torch model runner: real weights, the paged KV cache, real kernels.

It owns the device side of one engine: the model, one (k_cache, v_cache) pair per layer,
and the sampler. `execute` turns a SchedulerOutput into a forward pass over the flat batch
and samples one token for every request whose prefill or decode reached its last token.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from iterserve.replica.async_output import PendingOutput
from iterserve.replica.attention_metadata import AttentionMetadata, count_leading_decodes
from iterserve.replica.config import EngineConfig
from iterserve.replica.cpu_attention import CpuAttention, decode_work
from iterserve.replica.cpu_elementwise import CpuElementwise
from iterserve.replica.cpu_linear import pack_linears
from iterserve.replica.cuda_graphs import DecodeGraphRunner
from iterserve.replica.disk_kv_tier import block_layout_identity
from iterserve.replica.errors import DeviceFaultError
from iterserve.replica.host_kv_tier import kv_layout_signature
from iterserve.replica.input_batch import PreparedInputs, prepare_inputs
from iterserve.replica.kv_space import (
    decide_num_blocks,
    kv_bytes_per_block,
    open_disk_kv_tier,
    open_host_tier,
    profile_gpu_blocks,
)
from iterserve.replica.loader import load_checkpoint, load_dummy, weight_files_of
from iterserve.replica.lora_manager import LoRAManager
from iterserve.replica.ops import select_ops
from iterserve.replica.outputs import RunnerOutput, SchedulerOutput
from iterserve.replica.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from iterserve.replica.request import Request
from iterserve.replica.runner_base import CompletedStep, StepHandle
from iterserve.replica.sampler import Sampler, index_on_device
from iterserve.replica.startup import StartupRecorder, populate_page_cache
from iterserve.replica.step_inputs import PackedStepInputs

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_attention_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)  # process-wide: documented in EngineConfig
        self.ops = select_ops(self.attention_backend)
        self.cpu_attention: CpuAttention | None = None
        self.cpu_elementwise: CpuElementwise | None = None
        if self.device.type == "cpu" and self.attention_backend == "torch":
            self.cpu_attention = CpuAttention(config.cpu_prefill_attention,
                                              config.cpu_decode_attention)
            self.ops = self.cpu_attention.ops(self.ops)
            self.cpu_elementwise = CpuElementwise(config.cpu_elementwise)
            self.ops = self.cpu_elementwise.ops(self.ops)
        # Seconds and bytes per start-up stage (replica/startup.py): weights, KV cache, graph
        # capture. The replica reports them; the GPU first light reads startup_s.
        self.startup = StartupRecorder()
        dummy = config.load_format == "dummy"
        if not dummy:
            with self.startup.stage("weights_read"):
                populate_page_cache(weight_files_of(model_path))
        load = load_dummy if dummy else load_checkpoint
        with self.startup.stage("weights_place") as stage:
            self.model, self.model_config = load(model_path, self.dtype, self.device, self.ops,
                                                 copied=stage.copied)
            stage.copied(sum(p.nbytes for p in self.model.parameters()))
        with self.startup.stage("weights_pack") as stage:  # oneDNN's layout, written once
            self._linear_path = (pack_linears(self.model, config.cpu_linear, copied=stage.copied)
                                 if self.device.type == "cpu" else "")
        self.lora = (LoRAManager(self.model, self.model_config, config.max_loras,
                                 config.max_lora_rank, config.max_cpu_loras or config.max_loras)
                     if config.enable_lora else None)  # wraps the linears, base ones kept
        self.vocab_size = self.model_config.vocab_size
        self.block_size = config.cache.block_size
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 0)
        self.sampler = Sampler(config.seed, self.device)
        self._remember_sampled([], None)
        with self.startup.stage("kv_cache") as stage:  # sized (profiled) and allocated
            self._num_blocks = decide_num_blocks(
                config, self.device, self.kv_bytes_per_block,
                lambda: profile_gpu_blocks(self.model, self.model_config, config, self.device,
                                           self.dtype, self.kv_bytes_per_block))
            shape = (self._num_blocks, self.block_size, self.model_config.num_key_value_heads,
                     self.model_config.head_dim)
            if self.cpu_attention is not None:  # left unwritten: untouched pages cost no RAM
                self.kv_caches = [self.cpu_attention.allocate(*shape, self.dtype)
                                  for _ in range(self.model_config.num_hidden_layers)]
            else:
                self.kv_caches = [
                    (torch.zeros(shape, dtype=self.dtype, device=self.device),
                     torch.zeros(shape, dtype=self.dtype, device=self.device))
                    for _ in range(self.model_config.num_hidden_layers)
                ]
                stage.copied(sum(k.nbytes + v.nbytes for k, v in self.kv_caches))  # zeroed
            # What makes a block's bytes what they are besides its tokens: the disk tier's
            # folder and the layout key of blocks sent to another engine (kv_transfer.py).
            self.kv_layout_identity = block_layout_identity(  # load_dummy's weights: seed 0
                repr(self.model_config), None if dummy else weight_files_of(model_path),
                str(self.dtype), self.block_size, kv_layout_signature(*self.kv_caches[0]))
            self.host_tier = open_host_tier(config, self.device, self.kv_caches,
                                            self.kv_bytes_per_block)
            self.disk_tier = open_disk_kv_tier(config, self.kv_layout_identity, self.host_tier)
        if self.cpu_attention is not None and self.cpu_elementwise is not None:
            with self.startup.stage("graphs"):  # the compiled CPU ops, built before traffic
                mc = self.model_config
                self.cpu_attention.warm_up(self.kv_caches[0], mc.num_attention_heads, self.dtype,
                                           mc.num_attention_heads + 2 * mc.num_key_value_heads,
                                           self.model.model.layers[0].self_attn.scale)
                self._warm_up_elementwise(self.cpu_elementwise)
        self.step_inputs = PackedStepInputs(self.device)  # the eager step's one H2D copy
        self.graphs: DecodeGraphRunner | None = None
        # The LoRA rows -> slots change every step outside a captured graph: eager with LoRA.
        if self.device.type == "cuda" and not config.enforce_eager and self.lora is None:
            self.graphs = DecodeGraphRunner(self.model, self.kv_caches, self.device,
                                            max_batch_size=config.scheduler.max_num_seqs,
                                            max_blocks_per_seq=-(-config.scheduler.max_model_len
                                                                 // self.block_size),
                                            kv_splits_for=self._decode_kv_splits)
            with self.startup.stage("graphs"):
                self.graphs.capture()

    @property
    def startup_s(self) -> dict[str, float]:
        """Seconds per start-up stage this runner went through."""
        return self.startup.seconds()

    @property
    def cpu_paths(self) -> dict[str, str]:
        """Which CPU path each part runs ("onednn", "sdpa", "blocks", ...; a fallback says
        why), for the benchmarks and tests: a fallback is visible, never silent. Empty on
        CUDA."""
        if self.device.type != "cpu":
            return {}
        attention = (self.cpu_attention.paths if self.cpu_attention is not None else
                     {"prefill_attention": self.attention_backend,
                      "decode_attention": self.attention_backend})
        elementwise = (self.cpu_elementwise.path if self.cpu_elementwise is not None else
                       "eager")
        return {"linear": self._linear_path, **attention, "elementwise": elementwise}

    def _warm_up_elementwise(self, elementwise: CpuElementwise) -> None:
        mc, norm = self.model_config, self.model.model.norm
        elementwise.warm_up(mc.hidden_size, mc.intermediate_size, mc.num_attention_heads,
                            mc.num_key_value_heads, mc.head_dim, self.dtype, norm.weight,
                            norm.eps, self.model.cos_sin_cache)

    # ------------------------------------------------------------------------------ memory
    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.block_size, self.dtype)

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def num_host_kv_blocks(self) -> int:
        """How many blocks the host KV tier holds (0: no tier)."""
        return self.host_tier.num_slots if self.host_tier is not None else 0

    # ----------------------------------------------------------------------------- execute
    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        output = RunnerOutput()
        sampling = self._logits_to_sample(scheduler_output, output)
        if sampling is None:
            return output
        requests, logits = sampling
        token_ids, logprobs, failed = self.sampler.sample(logits, requests)
        for row, (request, token_id, lp) in enumerate(zip(requests, token_ids, logprobs,
                                                           strict=True)):
            if row in failed:
                output.failed[request.request_id] = failed[row]
                continue
            output.sampled_token_ids[request.request_id] = token_id
            if lp is not None:
                output.logprobs[request.request_id] = lp
        return output

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Enqueue the step on the device and return at once (async scheduling).

        The sampled ids stay on the device for the next step's pending decode inputs, and are
        copied to pinned host memory behind an event for result(). On CPU the step simply
        runs here."""
        scored = RunnerOutput()  # prompt logprobs, computed while launching
        sampling = self._logits_to_sample(scheduler_output, scored)
        if sampling is None:
            self._remember_sampled([], None)
            return CompletedStep(scored)
        requests, logits = sampling
        token_ids, log_probs, logprob_rows, failed = self.sampler.choose_tokens(logits, requests)
        self._remember_sampled(requests, token_ids)
        pending = PendingOutput(requests, token_ids, log_probs, logprob_rows, failed)
        return ScoredStep(pending, scored) if scored.prompt_logprobs else pending

    def _logits_to_sample(
        self, scheduler_output: SchedulerOutput, scored: RunnerOutput,
    ) -> tuple[list[Request], torch.Tensor] | None:
        """Run the forward pass; the requests that sample and their logits [S, V] fp32.
        Prompt logprobs of the chunks that ask for them go into `scored`."""
        self._copy_kv_blocks(scheduler_output)
        if scheduler_output.is_empty:
            return None
        prepared = prepare_inputs(scheduler_output, self.block_size)
        if self.lora is not None:
            self.lora.prepare(scheduler_output.scheduled)
        hidden, indices = self._forward(prepared)  # [T, hidden], [num_sampling]
        self._score_prompt_logprobs(scheduler_output, prepared, hidden, scored)
        if not prepared.sample_rows:
            return None
        logits = self.model.compute_logits(hidden[indices])  # [num_sampling, V] fp32
        return [scheduler_output.scheduled[i].request for i in prepared.sample_rows], logits

    def _copy_kv_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """The step's tier copies, before its forward: host blocks the host tier evicted read
        out for the disk (before anything overwrites their slots), evicted device blocks out
        (a block copied back may land in one of them), blocks read from disk into host
        slots, then the hits back in. The disk writes themselves run on the disk tier's
        writer thread."""
        tier, out = self.host_tier, scheduler_output
        if tier is None or not (out.kv_stores or out.kv_loads or out.kv_spills
                                or out.kv_disk_loads):
            return
        try:
            spilled = [(spill.stable, tier.read_slot(spill.host_slot)
                        if spill.host_slot is not None
                        else tier.read_device_block(self.kv_caches, spill.device_block))
                       for spill in out.kv_spills]
            tier.store(self.kv_caches, out.kv_stores)
            tier.write_slots(out.kv_disk_loads)
            tier.load(self.kv_caches, out.kv_loads)
        except Exception as error:  # noqa: BLE001 - re-raised as a fault of the whole step
            # Not one request's fault: fault isolation would rerun the requests one by one
            # without these copies, and a hit whose blocks never arrived would read stale KV.
            # Stopping the step is the only answer that never yields a wrong token.
            raise DeviceFaultError(f"host KV tier copy failed: {error!r}") from error
        for stable, payload in spilled:
            self.disk_tier.write_async(stable, payload)

    def _score_prompt_logprobs(self, scheduler_output: SchedulerOutput,
                               prepared: PreparedInputs, hidden: torch.Tensor,
                               output: RunnerOutput) -> None:
        """Prompt logprobs for this step's chunks of the requests that ask for them."""
        jobs = plan_prompt_logprobs(scheduler_output.scheduled, prepared.query_start_loc)
        if jobs:
            output.prompt_logprobs = compute_prompt_logprobs(hidden, self.model.compute_logits,
                                                             jobs)

    def _remember_sampled(self, requests: list[Request], token_ids: torch.Tensor | None) -> None:
        """Keep a launched step's sampled ids [S] on the device: the next step's decode
        inputs that are still placeholders are filled from them, in stream order."""
        self._last_sampled = token_ids
        self._last_sampled_row = {r.request_id: i for i, r in enumerate(requests)}

    def _pending_inputs(self, prepared: PreparedInputs
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat indices, token ids) on the device of the decode inputs the previous launched
        step is still sampling (async scheduling); None when every input is known."""
        if not prepared.pending_token_indices:
            return None
        rows = [self._last_sampled_row[rid] for rid in prepared.pending_request_ids]
        where = index_on_device(prepared.pending_token_indices, self.device)
        return where, self._last_sampled[index_on_device(rows, self.device)]

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device without waiting for queued work (non-blocking)."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _decode_kv_splits(self, num_decodes: int, max_decode_seq_len: int) -> int:
        """Split-KV ways for a batch's decode part (1 on the torch path: no split)."""
        if self.attention_backend != "triton" or self.device.type != "cuda":
            return 1
        from iterserve.kernels.ops import choose_num_splits

        return choose_num_splits(num_decodes, self.model_config.num_key_value_heads,
                                 max_decode_seq_len, self.num_sms)

    def _attention_launch_plan(self, prepared: PreparedInputs
                               ) -> tuple[int, int, dict[str, np.ndarray]]:
        """The Triton attention's launch hints from the host arrays: num_decodes, the split-KV
        ways from the decode part alone, and the work lists (host [P, 2] arrays): split_work
        (split-KV programs only for non-empty splits), prefill_work (heaviest blocks first)."""
        num_decodes = count_leading_decodes(prepared.query_start_loc)
        decode_lens = prepared.seq_lens[:num_decodes]
        splits = self._decode_kv_splits(num_decodes, int(decode_lens.max())) if num_decodes else 1
        work: dict[str, np.ndarray] = {}
        if self.cpu_attention is not None and self.cpu_attention.decode == "blocks":
            if num_decodes:  # the CPU decode's (sequence, block) pairs, once per step
                work["split_work"] = decode_work(decode_lens, prepared.block_tables,
                                                 self.block_size)
            return num_decodes, splits, work
        if self.attention_backend != "triton":
            return num_decodes, splits, work
        from iterserve.kernels import work_lists

        mc = self.model_config
        if splits > 1:
            work["split_work"] = work_lists.split_work(decode_lens, splits, mc.head_dim)
        if num_decodes < prepared.seq_lens.shape[0]:
            work["prefill_work"] = work_lists.prefill_work(
                prepared.query_start_loc[num_decodes:], prepared.seq_lens[num_decodes:],
                mc.num_attention_heads // mc.num_key_value_heads)
        return num_decodes, splits, work

    def _forward(self, prepared: PreparedInputs
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # -> [T, hidden], [num_sampling]
        if self.graphs is not None and prepared.is_decode_only and self.graphs.can_run(prepared):
            hidden = self.graphs.run(prepared, self._pending_inputs(prepared))
            return hidden, self._to_device(prepared.logits_indices)
        num_decodes, num_kv_splits, work = self._attention_launch_plan(prepared)
        pending = {"pending_where": np.asarray(prepared.pending_token_indices),
                   "pending_rows": np.asarray([self._last_sampled_row[rid]
                                               for rid in prepared.pending_request_ids])}
        inputs = self.step_inputs.upload({
            "input_ids": prepared.input_ids, "positions": prepared.positions,
            "slot_mapping": prepared.slot_mapping, "query_start_loc": prepared.query_start_loc,
            "seq_lens": prepared.seq_lens, "block_tables": prepared.block_tables,
            "logits_indices": prepared.logits_indices, **pending, **work,
        })  # every index input in one host-to-device copy, int32 views of one buffer
        attn = AttentionMetadata(
            query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"],
            block_tables=inputs["block_tables"],
            slot_mapping=inputs["slot_mapping"],
            max_query_len=prepared.max_query_len,
            max_seq_len=prepared.max_seq_len,
            is_decode_only=prepared.is_decode_only,
            num_decodes=num_decodes,
            num_kv_splits=num_kv_splits,
            split_work=inputs.get("split_work"),
            prefill_work=inputs.get("prefill_work"),
        )
        input_ids = inputs["input_ids"]  # [T]
        if prepared.pending_token_indices:  # async scheduling: ids the last step is sampling
            sampled = self._last_sampled[inputs["pending_rows"]]
            input_ids[inputs["pending_where"]] = sampled.to(torch.int32)
        hidden = self.model(input_ids, inputs["positions"], self.kv_caches, attn)
        return hidden, inputs["logits_indices"]


class ScoredStep:
    """A launched step plus the prompt logprobs computed while it was launched."""

    def __init__(self, step: StepHandle, scored: RunnerOutput) -> None:
        self._step = step
        self._scored = scored

    def result(self) -> RunnerOutput:
        output = self._step.result()
        output.prompt_logprobs = self._scored.prompt_logprobs
        return output
