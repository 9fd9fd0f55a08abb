"""The launches the engine can make, built from host tensors for `aot.py` to compile.

Attention launches come from the launchers' own builders (`batch_launches`,
`split_kv_launches`), so their grids, constexprs, warps and stages are the runtime's; the
tensors are shaped, typed and strided as the engine's step makes them (q/k/v are strided
views of the fused qkv projection, block tables int32). The small kernels' arguments mirror
their launchers (norm.py, activation.py, rotary.py, kv_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from iterserve.kernels._common import elementwise_num_warps, next_power_of_2
from iterserve.kernels.activation import silu_and_mul_kernel
from iterserve.kernels.attention_core import SUPPORTED_HEAD_DIMS
from iterserve.kernels.kv_cache import write_kv_cache_kernel
from iterserve.kernels.launch import Launch
from iterserve.kernels.norm import rms_norm_kernel
from iterserve.kernels.paged_attention import batch_launches
from iterserve.kernels.rotary import rotary_embedding_kernel
from iterserve.kernels.split_kv import SPLIT_COUNTS
from iterserve.kernels.work_lists import prefill_work, split_work

# (head_dim, group, kv heads, model): the head layouts of the models the engine serves.
MODEL_HEADS = [
    (64, 3, 3, "SmolLM2-135M"),
    (64, 4, 8, "Llama-3.2-1B"),
    (128, 4, 8, "Llama-3-8B"),
    (128, 8, 8, "Llama-3-70B"),
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_BLOCKS_PER_SEQ = 512  # max_model_len 8192 / block 16


def _batch(
    head_dim: int,
    group: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    block_size: int,
    q_lens: list[int],
) -> dict[str, object]:
    """A flat batch laid out as the engine's step lays it out (host tensors, never read)."""
    num_heads, num_tokens = group * num_kv_heads, sum(q_lens)
    qkv = torch.empty(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided view
    cache_shape = (64, block_size, num_kv_heads, head_dim)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return {
        "out": torch.empty(num_tokens, num_heads, head_dim, dtype=dtype),
        "query": query,
        "k_cache": torch.empty(cache_shape, dtype=dtype),
        "v_cache": torch.empty(cache_shape, dtype=dtype),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "seq_lens": torch.tensor([q + 100 for q in q_lens], dtype=torch.int32),
        "block_tables": torch.zeros(len(q_lens), MAX_BLOCKS_PER_SEQ, dtype=torch.int32),
        "scale": head_dim**-0.5,
    }


def attention_launches(
    head_dim: int,
    group: int,
    num_kv_heads: int,
    dtype: str,
    block_size: int,
    split_counts: tuple[int, ...],
) -> Iterator[tuple[str, Launch]]:
    """Decode, chunk (one and several chunks) and split-KV launches of one head layout; the
    chunk launch and split-KV stage 1 also over the eager step's host-built work lists."""
    tag = f"D={head_dim},G={group},B={block_size},{dtype}"
    mixed = _batch(head_dim, group, num_kv_heads, DTYPES[dtype], block_size, [1] * 64 + [512, 300])
    for launch in batch_launches(**mixed, num_decodes=64, num_kv_splits=1):
        yield f"{launch.name}[{tag}]", launch
    # Eager steps: the chunk launch over a host-built, heaviest-first work list.
    work = torch.from_numpy(prefill_work(mixed["query_start_loc"][64:].numpy(),
                                         mixed["seq_lens"][64:].numpy(), group))
    *_, chunks = batch_launches(**mixed, num_decodes=64, num_kv_splits=1, prefill_work=work)
    yield f"{chunks.name}[{tag},work list]", chunks
    one_chunk = _batch(head_dim, group, num_kv_heads, DTYPES[dtype], block_size, [2048])
    (launch,) = batch_launches(**one_chunk, num_decodes=0, num_kv_splits=1)
    yield f"{launch.name}[{tag},1 chunk]", launch
    for splits in split_counts:
        small = _batch(head_dim, group, num_kv_heads, DTYPES[dtype], block_size, [1] * 2)
        for launch in batch_launches(**small, num_decodes=2, num_kv_splits=splits):
            yield f"{launch.name}[{tag},splits={splits}]", launch
        # Eager steps: stage 1 over a host-built work list (the reduce is the same launch).
        work = torch.from_numpy(split_work(small["seq_lens"].numpy(), splits, head_dim))
        stage1, _ = batch_launches(**small, num_decodes=2, num_kv_splits=splits, split_work=work)
        yield f"{stage1.name}[{tag},splits={splits},work list]", stage1


def small_launches(dtype: torch.dtype, tag: str) -> Iterator[tuple[str, Launch]]:
    tokens = 256
    for hidden, add in [(2048, True), (4096, False), (8192, True)]:
        x = torch.empty(tokens, hidden, dtype=dtype)
        block = next_power_of_2(hidden)
        yield f"rms_norm[H={hidden},add={add},{tag}]", Launch(
            "rms_norm", rms_norm_kernel, (tokens,),
            (x, x, torch.empty(hidden, dtype=dtype), torch.empty_like(x), torch.empty_like(x),
             hidden, hidden if add else 0, hidden, 1e-5),
            {"ADD_RESIDUAL": add, "BLOCK": block}, elementwise_num_warps(block), 3,
        )  # fmt: skip
    # Positions and slots: int32 from the engine (both its packed input buffers), int64 from
    # direct callers of the launchers.
    for (num_heads, num_kv_heads, head_dim), index in [
        ((32, 8, 128), torch.int64), ((32, 8, 128), torch.int32), ((32, 8, 64), torch.int64)
    ]:
        index_tag = "i64" if index == torch.int64 else "i32"
        qkv = torch.empty(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
        q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        k = qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
        cos_sin = torch.empty(8192, head_dim, dtype=torch.float32)
        half = head_dim // 2
        block_half = next_power_of_2(half)
        block_h = min(next_power_of_2(max(num_heads, num_kv_heads)), max(1, 2048 // block_half))
        yield f"rotary[D={head_dim},{tag},{index_tag}]", Launch(
            "rotary", rotary_embedding_kernel, (tokens,),
            (torch.empty(tokens, dtype=index), q, k, cos_sin, q.stride(0), q.stride(1),
             k.stride(0), k.stride(1), cos_sin.stride(0), num_heads, num_kv_heads, half),
            {"BLOCK_H": block_h, "BLOCK_HALF": block_half}, 4, 3,
        )  # fmt: skip
        v = qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
        cache = torch.empty(64, 16, num_kv_heads, head_dim, dtype=dtype)
        block_d = next_power_of_2(head_dim)
        block_h = min(next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
        yield f"write_kv_cache[D={head_dim},{tag},{index_tag}]", Launch(
            "write_kv_cache", write_kv_cache_kernel, (tokens, 1),
            (k, v, cache, torch.empty_like(cache), torch.empty(tokens, dtype=index),
             k.stride(0), k.stride(1), v.stride(0), v.stride(1),
             cache.stride(0), cache.stride(1), cache.stride(2), num_kv_heads, head_dim),
            {"BLOCK_SIZE": 16, "BLOCK_H": block_h, "BLOCK_D": block_d}, 4, 3,
        )  # fmt: skip
    x = torch.empty(tokens, 2 * 8192, dtype=dtype)
    yield f"silu_and_mul[I=8192,{tag}]", Launch(
        "silu_and_mul", silu_and_mul_kernel, (tokens, 8),
        (x, torch.empty(tokens, 8192, dtype=dtype), x.stride(0), 8192), {"BLOCK": 1024}, 4, 3,
    )  # fmt: skip


def all_launches() -> Iterator[tuple[str, Launch]]:
    """Every specialisation the engine can launch on a GPU, bf16 first (the serving dtype)."""
    for head_dim, group, num_kv_heads, _ in MODEL_HEADS:
        yield from attention_launches(head_dim, group, num_kv_heads, "bf16", 16, SPLIT_COUNTS[1:])
    for head_dim in SUPPORTED_HEAD_DIMS:
        if head_dim not in {d for d, *_ in MODEL_HEADS}:
            yield from attention_launches(head_dim, 4, 2, "bf16", 16, (8,))
    yield from attention_launches(128, 4, 8, "bf16", 32, (8,))  # block size 32
    yield from attention_launches(128, 4, 8, "fp16", 16, (8,))
    yield from attention_launches(64, 4, 8, "fp32", 16, (8,))  # ieee fp32 dots: the test dtype
    yield from small_launches(torch.bfloat16, "bf16")
