"""Plain-torch equivalents of every Triton kernel in this package.

These are the engine's CPU path and the ground truth the kernel tests compare against.
Every function computes in fp32 and casts back to the input dtype, as the kernels do.

Shapes use these letters:
    T  tokens in the flat batch (prefill chunks and decodes together)
    S  sequences in the batch
    Hq query heads, Hkv key/value heads (Hq % Hkv == 0), D head dim
    N  KV-cache blocks, B block size (tokens per block), M max blocks per sequence

KV cache layout, one pair per layer: k_cache, v_cache: [N, B, Hkv, D].
"""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, slot = block * B + offset; -1 is padding
) -> None:
    """Store each token's key and value at its slot; slots of -1 are skipped."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    slots = slot_mapping.long()
    if not bool((slots >= 0).all()):  # padding: keep the real tokens (boolean masks sync)
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    query_start_loc: torch.Tensor,  # [S + 1] int, query tokens of seq i are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor,  # [S] int, context length including this step's tokens
    block_tables: torch.Tensor,  # [S, M] int
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of a ragged batch over the paged cache.

    The cache must already hold this step's keys and values. The last q_len tokens of a
    sequence's context are its queries, so query j of a chunk sees context positions
    0 .. seq_len - q_len + j. A decode is a chunk of length 1; a full prefill is a chunk with
    seq_len == q_len.

    This is also the engine's CPU attention, a Python loop over sequences, so the loop body is
    kept to few torch calls (each costs microseconds of dispatch, times sequences times
    layers): the queries are scaled once for the whole batch, the block tables made int64
    once, and a decode's output is written straight into `out` in fp32.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    in_place = query.dtype == torch.float32  # a decode's fp32 result needs no cast
    # Grouped under their shared KV head: [T, Hkv, group, D]. Scaling the queries instead of
    # the scores is exact for power-of-two scales (head_dim 64, 256) and within rounding else.
    queries = (query.float() * scale).view(num_tokens, num_kv_heads, group, head_dim)
    tables = block_tables.long()
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = tables[i, : (seq_len + block_size - 1) // block_size]
        keys = _gather_blocks(k_cache, blocks, seq_len).float()  # [L, Hkv, D]
        values = _gather_blocks(v_cache, blocks, seq_len).float()  # [L, Hkv, D]
        if q_len == 1:  # a decode: its single query sees its whole context, nothing to mask
            probs = torch.softmax(torch.matmul(queries[q_start], keys.permute(1, 2, 0)), dim=-1)
            o = out[q_start].view(num_kv_heads, group, head_dim)
            if in_place:
                torch.matmul(probs, values.transpose(0, 1), out=o)  # [Hkv, group, D]
            else:
                o.copy_(torch.matmul(probs, values.transpose(0, 1)))
            continue
        # [Hkv, group * q_len, D], rows ordered (group, query)
        q = queries[q_start:q_end].permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, -1)
        scores = torch.matmul(q, keys.permute(1, 2, 0))  # [Hkv, group * q_len, L]
        # On the scores' device: a CPU mask on CUDA scores is a device-mismatch error.
        device = scores.device
        query_pos = torch.arange(seq_len - q_len, seq_len, device=device).repeat(group)
        key_pos = torch.arange(seq_len, device=device)
        scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, values.transpose(0, 1))  # [Hkv, group * q_len, D]
        o = o.view(num_kv_heads, group, q_len, -1).permute(2, 0, 1, 3).reshape(q_len, num_heads, -1)
        out[q_start:q_end] = o.to(query.dtype)
    return out


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` cached tokens of one sequence, in order, from its blocks (int64)."""
    # index_select copies blocks about 3x faster than advanced indexing on CPU.
    return torch.index_select(cache, 0, blocks).view(-1, *cache.shape[2:])[:context_len]


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], new residual x + residual [T, H]
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, Hq, D], rotated in place
    key: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, D]: cos in [:, :D/2], sin in [:, D/2:]
) -> None:
    """Neox-style (rotate-half) rotary embedding, the layout of HF Llama, Qwen2 and Mistral.

    With x = [x1 | x2]: [x1 cos - x2 sin | x2 cos + x1 sin], computed as
    x * [cos | cos] + [x2 | x1] * [-sin | sin], which rounds identically (negation is exact)
    in fewer torch calls: this is also the engine's CPU path, once per layer."""
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, D]
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]  # [T, 1, D/2]
    cos_full, sin_signed = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    for tensor in (query, key):
        x = tensor.float()
        rotated = x * cos_full
        rotated += torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed
        tensor.copy_(rotated)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x: [T, 2I] -> [T, I]
    """SwiGLU's activation: silu(gate) * up, with gate and up packed as [gate | up]."""
    half = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :half]) * xf[..., half:]).to(x.dtype)


def paged_decode_attention(
    query: torch.Tensor,  # [S, Hq, D], one decode token per sequence
    k_cache: torch.Tensor,  # [N, B, Hkv, D]
    v_cache: torch.Tensor,  # [N, B, Hkv, D]
    seq_lens: torch.Tensor,  # [S] int, context length including this step's token
    block_tables: torch.Tensor,  # [S, M] int
    scale: float,
) -> torch.Tensor:  # [S, Hq, D]
    """Decode-only attention: the reference for ops.paged_decode_attention_split_kv."""
    query_start_loc = torch.arange(query.shape[0] + 1, device=query.device)
    return paged_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
