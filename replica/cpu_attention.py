"""The engine's attention on CPU: SDPA for prefill chunks, compiled block decoding for decodes.

kernels/reference.py loops over sequences, about ten torch calls per sequence per layer on one
core. On a CPU that loop was 30-40 % of a 32-sequence decode step (BENCHMARKS.md). Here:

* decodes (the batch's leading one-token queries) run as one compiled function over every
  (sequence, KV block) pair of the batch, as flash-decoding splits the context: each pair's
  scores, max, exp-sum and weighted values from the cache blocks in place (no gather copy, no
  padding), then one combine per sequence. Inductor turns it into C++ loops parallel over the
  pairs. The pairs come from the runner's host arrays (`decode_work`), through
  AttentionMetadata.split_work, once per step.
* prefill chunks run torch's fused SDPA (flash attention on CPU), each over its context
  gathered from its blocks; a chunk after a cached prefix as two flash calls (the prefix
  unmasked, its own keys causal) merged by log-sum-exp, rather than one with a mask.
* the K cache is stored block-transposed, [N, Hkv, D, B], and handed out as the [N, B, Hkv, D]
  view every op takes: the decode scores then vectorise over a block's 16 tokens instead of
  reducing 64-wide dot products one at a time (measured 2x). Block ids, prefix caching and
  preemption see blocks only; only writes and gathers see strides (`write_kv_cache` here).

Each part is a setting (`cpu_prefill_attention`, `cpu_decode_attention`); a compile that fails
at start-up or later falls back to the reference loop with one warning, and `paths` says so.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from iterserve.kernels import reference
from iterserve.replica.ops import Ops

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [N, B, Hkv, D] each
# Each model shape (heads, head dim, block size, dtype, strides) compiles its own graph, and
# the test suite builds many: dynamo's default of 8 per function would silently run the rest
# eagerly, 60x slower than the loop.
RECOMPILE_LIMIT = 64


def decode_work(seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int) -> np.ndarray:
    """[P + 1, 3] int32: (sequence, physical block, tokens in it) for every KV block of every
    decode, sequence by sequence, then one empty pair (no tokens). The empty pair keeps P >= 2
    so that a one-block batch does not compile a graph of its own (dynamo specialises 1)."""
    # seq_lens: [S] decode context lengths; block_tables: [>= S, M]
    num_blocks = -(-seq_lens.astype(np.int64) // block_size)  # [S]
    seq = np.repeat(np.arange(seq_lens.shape[0]), num_blocks)  # [P]
    first = np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)  # [P]
    index = np.arange(seq.shape[0]) - first  # [P], block index within its sequence
    work = np.zeros((seq.shape[0] + 1, 3), dtype=np.int32)
    work[:-1, 0] = seq
    work[:-1, 1] = block_tables[seq, index]
    work[:-1, 2] = np.minimum(block_size, seq_lens[seq] - index * block_size)
    return work


def decode_blocks(
    query: torch.Tensor,  # [S, Hq, D], one decode token per sequence (a strided view)
    k_cache: torch.Tensor,  # [N, B, Hkv, D], any strides
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    work: torch.Tensor,  # [P, 3] int32, decode_work's (sequence, block, tokens)
    scale: float,
) -> torch.Tensor:  # [S, Hq, D] float32
    """Decode attention over (sequence, block) pairs, combined per sequence (flash-decoding
    with one split per KV block). Written for inductor: every step below fuses into loops
    over the pairs that read the cache blocks where they are."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    seq, block, tokens = work[:, 0].long(), work[:, 1].long(), work[:, 2].long()  # [P] each
    q = (query.float() * scale).view(num_seqs, num_kv_heads, group, head_dim)[seq]  # [P,Hkv,G,D]
    valid = torch.arange(block_size, device=query.device)[None, :] < tokens[:, None]  # [P, B]
    keys = k_cache[block].float().permute(0, 2, 3, 1)  # [P, Hkv, D, B]
    scores = (q[..., None] * keys[:, :, None]).sum(3)  # [P, Hkv, G, B]
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    block_max = scores.amax(-1)  # [P, Hkv, G]; -inf for the empty pair
    # Masked again after exp: the empty pair's exp(-inf - -inf) is NaN.
    probs = torch.where(valid[:, None, None], torch.exp(scores - block_max[..., None]), 0.0)
    block_sum = probs.sum(-1)  # [P, Hkv, G]
    # Zeroed, not just weighted by 0: unwritten slots may hold NaN.
    values = torch.where(valid[:, :, None, None], v_cache[block].float(), 0.0)  # [P, B, Hkv, D]
    block_out = (probs.permute(0, 3, 1, 2)[..., None] * values[:, :, :, None]).sum(1)  # [P,Hkv,G,D]
    # Combine each sequence's pairs: weights exp(block max - sequence max).
    where = seq[:, None, None].expand_as(block_max)  # [P, Hkv, G]
    seq_max = torch.full((num_seqs, num_kv_heads, group), float("-inf"), device=query.device)
    seq_max = seq_max.scatter_reduce(0, where, block_max, reduce="amax")  # [S, Hkv, G]
    weight = torch.exp(block_max - seq_max[seq])  # [P, Hkv, G]; 0 for the empty pair
    total = torch.zeros((num_seqs, num_kv_heads, group), device=query.device)
    total = total.index_add(0, seq, block_sum * weight)  # [S, Hkv, G]
    out = torch.zeros((num_seqs, num_kv_heads, group, head_dim), device=query.device)
    out = out.index_add(0, seq, block_out * weight[..., None])  # [S, Hkv, G, D]
    return (out / total[..., None]).view(num_seqs, num_heads, head_dim)


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D], possibly the block-transposed view
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, block * B + offset; -1 is padding
) -> None:
    """reference.write_kv_cache for caches of any strides (it flattens contiguous ones)."""
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    if not bool((slots >= 0).all()):
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks, offsets = slots // block_size, slots % block_size  # [T] each
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


@functools.cache
def compiled_decode_blocks() -> Callable[..., torch.Tensor]:
    """decode_blocks under torch.compile, one wrapper per process: dynamo keys its graphs by
    function and backend, so engines of the same model shape share a graph (and inductor's
    on-disk cache serves later processes). Sizes that change between steps are marked
    dynamic by the caller; the rest (heads, head dim, block size, dtype, strides) are baked
    in."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(decode_blocks, dynamic=False)


class CpuAttention:
    """The CPU attention of one engine: its settings, its compiled decode, what ran."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill = prefill  # "sdpa" or "loop"
        self.decode = decode  # "blocks" or "loop"
        self.decode_note = ""  # why decode fell back, when it did
        self.compile_seconds = 0.0
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._compile_pending = decode == "blocks"

    @property
    def paths(self) -> dict[str, str]:
        decode = self.decode + (f" (fallback: {self.decode_note})" if self.decode_note else "")
        return {"prefill_attention": self.prefill, "decode_attention": decode}

    def ops(self, base: Ops) -> Ops:
        """`base` (the torch reference ops) with this attention and its cache writes."""
        return dataclasses.replace(base, paged_attention=self.paged_attention,
                                   write_kv_cache=write_kv_cache)

    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> KVCache:
        """One layer's caches, [N, B, Hkv, D] each; K block-transposed for the block decode.
        Left uninitialised: a slot is read only after this step or an earlier one wrote it
        (masked reads of the rest zero them), and untouched memory costs no RAM."""
        value = torch.empty((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype)
        if self.decode != "blocks":
            return torch.empty_like(value), value
        key = torch.empty((num_blocks, num_kv_heads, head_dim, block_size), dtype=dtype)
        return key.permute(0, 3, 1, 2), value

    @torch.inference_mode()  # as the engine's steps run: grad mode is part of dynamo's guards
    def warm_up(self, kv_cache: KVCache, num_heads: int, dtype: torch.dtype,
                fused_heads: int | None = None, scale: float | None = None) -> None:
        """Compile the decode for one and for several sequences now, not on the first
        request; a failure falls back to the loop (one warning). Times the compile.

        Called as the model will call it, since dynamo guards on all of it: the queries a view
        of the fused q/k/v projection (`fused_heads` = Hq + 2 Hkv heads per token), the
        model's softmax scale (default head_dim ** -0.5), inference mode."""
        start = time.perf_counter()
        if self._compiled_decode() is None:
            return
        k_cache, v_cache = kv_cache
        head_dim = k_cache.shape[3]
        for num_seqs in (1, 2):  # dynamo compiles 1 apart from the dynamic size
            fused = torch.zeros((num_seqs, fused_heads or num_heads, head_dim), dtype=dtype)
            query = fused[:, :num_heads]  # [S, Hq, D]
            seq_lens = np.ones(num_seqs, dtype=np.int32)
            tables = np.zeros((num_seqs, 1), dtype=np.int32)
            work = torch.from_numpy(decode_work(seq_lens, tables, k_cache.shape[1]))
            self._decode(query, k_cache, v_cache, work, scale or head_dim**-0.5)
        self.compile_seconds = time.perf_counter() - start

    def _compiled_decode(self) -> Callable[..., torch.Tensor] | None:
        """The compiled decode, its wrapper made on first use: torch.compile imports dynamo
        and inductor (seconds), which the engine's start then counts in its graphs stage, not
        before its first stage. None for the loop, or once the compiled path has failed."""
        if self._compile_pending:
            self._compile_pending = False
            self._compiled = compiled_decode_blocks()
        return self._compiled

    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                work: torch.Tensor, scale: float) -> torch.Tensor | None:
        """The compiled decode ([S, Hq, D] fp32), or None once it has failed."""
        compiled = self._compiled_decode()
        if compiled is None:
            return None
        for tensor in (query, work, k_cache, v_cache):  # sizes that change between steps
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        try:
            return compiled(query, k_cache, v_cache, work, scale)
        except Exception as error:  # inductor and the C++ compiler raise many types: any
            # failure means the compiled path is gone for this engine, and the loop is exact
            self._compiled = None
            self.decode = "loop"
            first_line = (str(error).splitlines() or [""])[0]
            self.decode_note = f"{type(error).__name__}: {first_line[:200]}"
            logger.warning("CPU decode attention falls back to the per-sequence loop: %s",
                           self.decode_note)
            return None

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                        num_decodes: int = 0, split_work: torch.Tensor | None = None,
                        **_launch_hints: Any) -> torch.Tensor:  # [T, Hq, D]
        """reference.paged_attention's contract. The first `num_decodes` sequences have one
        query each (the runner lays decodes out first); `split_work` is their decode_work,
        built once per step by the runner (computed here when a caller gave none)."""
        out = torch.empty(query.shape, dtype=query.dtype)  # [T, Hq, D]
        decoded = 0
        if num_decodes and self._compiled_decode() is not None:
            if split_work is None:
                split_work = torch.from_numpy(decode_work(
                    seq_lens[:num_decodes].numpy(), block_tables.numpy(), k_cache.shape[1]))
            result = self._decode(query[:num_decodes], k_cache, v_cache, split_work, scale)
            if result is not None:
                out[:num_decodes] = result
                decoded = num_decodes
        if self.prefill == "sdpa":
            self._loop(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                       out, decoded, num_decodes)
            self._prefill_sdpa(query, k_cache, v_cache, query_start_loc, seq_lens,
                               block_tables, scale, out, num_decodes)
        else:
            self._loop(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                       out, decoded, seq_lens.shape[0])
        return out

    @staticmethod
    def _loop(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
              scale: float, out: torch.Tensor, first: int, last: int) -> None:
        """The reference loop over sequences [first, last), into `out`."""
        if first >= last:
            return
        starts = query_start_loc[first : last + 1]  # [n + 1]
        rows = slice(int(starts[0]), int(starts[-1]))
        out[rows] = reference.paged_attention(query[rows], k_cache, v_cache, starts - starts[0],
                                              seq_lens[first:last], block_tables[first:last],
                                              scale)

    @staticmethod
    def _prefill_sdpa(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, out: torch.Tensor,
                      first: int) -> None:
        """Each sequence from `first` on (the prefill chunks): flash attention over its
        context gathered from its blocks. The chunk's queries are the last q_len positions of
        that context: is_causal when the chunk is the whole context, else
        `chunk_after_prefix`."""
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        starts = query_start_loc.tolist()
        for i, seq_len in enumerate(seq_lens.tolist()[first:], start=first):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            if q_len == 0:
                continue
            blocks = block_tables[i, : -(-seq_len // block_size)].long()
            keys = torch.index_select(k_cache, 0, blocks).view(-1, num_kv_heads, head_dim)
            values = torch.index_select(v_cache, 0, blocks).view(-1, num_kv_heads, head_dim)
            # 4-D views with the head dim innermost select the flash kernel; 3-D ones do not.
            q = query[q_start:q_end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            k = keys[:seq_len].transpose(0, 1)[None]  # [1, Hkv, L, D]
            v = values[:seq_len].transpose(0, 1)[None]
            if seq_len > q_len:
                o = chunk_after_prefix(q, k, v, seq_len - q_len, scale)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=True)
            out[q_start:q_end] = o[0].transpose(0, 1)  # [q_len, Hq, D]


def chunk_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                       scale: float) -> torch.Tensor:  # [1, Hq, q_len, D]
    """Attention of a chunk's queries (q: [1, Hq, q_len, D]) over a context (k, v:
    [1, Hkv, L, D]) whose first prefix_len positions precede the chunk: query j sees keys up
    to prefix_len + j (the bottom-right causal mask). Computed as two flash calls, the whole
    prefix unmasked and the chunk's own keys causal, merged by their log-sum-exps: a [q_len, L]
    mask would make the kernel read a mask element per score and compute the chunk's masked
    upper triangle (1.12-1.17x slower at q_len 512 after 1500-3000 cached, 1.47x at 2048
    after 2048: loadtests/studies/engine_speed). torch's flash op on CPU takes grouped K/V
    heads as SDPA's enable_gqa does."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    prefix_out, prefix_lse = flash(q, k[:, :, :prefix_len], v[:, :, :prefix_len],
                                   scale=scale)[:2]  # [1, Hq, q_len, D], [1, Hq, q_len]
    own_out, own_lse = flash(q, k[:, :, prefix_len:], v[:, :, prefix_len:], is_causal=True,
                             scale=scale)[:2]
    top = torch.maximum(prefix_lse, own_lse)
    prefix_weight = torch.exp(prefix_lse - top)[..., None]  # [1, Hq, q_len, 1]
    own_weight = torch.exp(own_lse - top)[..., None]
    merged = prefix_out * prefix_weight + own_out * own_weight
    return (merged / (prefix_weight + own_weight)).to(q.dtype)
