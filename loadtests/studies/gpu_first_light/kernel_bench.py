"""GPU benchmark of the Triton kernels and the engine's decode step, one markdown table.

    python -m iterserve.loadtests.studies.gpu_first_light.kernel_bench [--out report.md] [--skip-engine]

1. bf16 correctness of every launcher against iterserve.kernels.reference.
2. Device-to-device copy bandwidth, the practical ceiling for memory-bound kernels.
3. Paged decode attention (Llama-3-8B heads: 32 q heads, 8 KV heads, head dim 128, bf16) at
   batch 1/16/64/256 x context 512/4096/16384, the engine's launch choice (decode launch or
   split-KV from choose_num_splits), KV GB/s as % of copy bandwidth. Floors: >= 85 % for
   batch >= 16 and context >= 4k, >= 60 % for batch 1 x 4k.
4. Prefill of one 4K and one 16K chunk, TFLOPS against causal SDPA.
5. The engine's decode step on a Llama-3.2-1B-shaped model with CUDA graphs against the byte
   floor (loadtests/studies/gpu_first_light/engine_decode_bench.py). Floor: <= 1.2x.

Every measurement is one row of one table: section, case, measured, floor, verdict. Exit code
1 if a correctness check or a floor fails (after the report is written). Needs a CUDA GPU;
sized to finish in under five minutes on an H200 (--budget-s skips what would overrun).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
# A module constant so a CPU smoke test can run this script's code paths in the interpreter.
DEVICE = "cuda"
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 16384)
PREFILL_LENS = (4096, 16384)
# The correctness batch: three decodes, a full 200-token prefill, a 77-token chunk on context.
CHECK_Q_LENS = (1, 1, 1, 200, 77)
CHECK_SEQ_LENS = (17, 1000, 1537, 200, 600)
CHECK_ROWS = 67
TOLERANCE = {"atol": 1.5e-2, "rtol": 1e-2}  # bf16 attention norm (vLLM's tolerance)


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds per call (CUDA events, L2 flushed between reps)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _bench_graph(fn: Callable[[], object]) -> float | str:
    """Median ms with the call captured in a CUDA graph (no launch overhead), or why not."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except RuntimeError as exc:  # a capture failure is reported in the table, not hidden
        return f"n/a ({str(exc).splitlines()[0][:40]})"


def _bench_baseline(fn: Callable[[], object]) -> float | str:
    """Median ms of a torch baseline, or why it could not run (e.g. no SDPA backend for the
    shape); the comparison column says so instead of the whole benchmark dying."""
    try:
        return _bench(fn)
    except RuntimeError as exc:
        return f"n/a ({str(exc).splitlines()[0][:40]})"


def _table(header: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _paged_cache(
    seq_lens: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # k_cache, v_cache [N, B, Hkv, D], tables [S, M]
    """A cache holding exactly these sequences, their blocks shuffled across the pool."""
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)
    v_cache = torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen).int()
    tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32, device=DEVICE)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[start : start + n]
        start += n
    return k_cache, v_cache, tables


def _contiguous(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[S, Hkv, ctx, D]: the same tokens as the paged cache, one dense tensor per batch."""
    gathered = cache[tables.long()]  # [S, M, B, Hkv, D]
    return gathered.flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()


def check_correctness(gen: torch.Generator) -> list[list[object]]:
    """Every launcher in bf16 against the reference (fp32 math in both)."""
    from iterserve.kernels import ops
    from iterserve.kernels import reference as ref

    rows: list[list[object]] = []

    def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = (got.float() - want.float()).abs().max().item()
        ok = torch.allclose(got.float(), want.float(), **TOLERANCE)
        rows.append([name, f"{err:.2e}", "ok" if ok else "MISMATCH"])  # name, error, status

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, dtype=DTYPE, device=DEVICE, generator=gen)

    x, res, w = randn(CHECK_ROWS, 4096), randn(CHECK_ROWS, 4096), randn(4096)
    record("rms_norm", ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    got, want = ops.fused_add_rms_norm(x, res, w, 1e-6), ref.fused_add_rms_norm(x, res, w, 1e-6)
    record("fused_add_rms_norm (normed)", got[0], want[0])
    record("fused_add_rms_norm (residual)", got[1], want[1])
    g = randn(CHECK_ROWS, 2 * 14336)
    record("silu_and_mul", ops.silu_and_mul(g), ref.silu_and_mul(g))

    positions = torch.randint(0, 8192, (CHECK_ROWS,), device=DEVICE, generator=gen)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE) / HEAD_DIM))
    freqs = torch.outer(torch.arange(8192, device=DEVICE, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    q, k = randn(CHECK_ROWS, NUM_HEADS, HEAD_DIM), randn(CHECK_ROWS, NUM_KV_HEADS, HEAD_DIM)
    q_ref, k_ref = q.clone(), k.clone()
    ops.rotary_embedding(positions, q, k, cos_sin)
    ref.rotary_embedding(positions, q_ref, k_ref, cos_sin)
    record("rotary_embedding (q)", q, q_ref)
    record("rotary_embedding (k)", k, k_ref)

    q_lens, seq_lens = list(CHECK_Q_LENS), list(CHECK_SEQ_LENS)
    k_cache, v_cache, tables = _paged_cache(seq_lens, gen)
    slots = tables[3].long()[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=DEVICE)
    # Rewrite the full prefill's keys and values (sequence 3, q_len == seq_len) in place.
    slots = slots.flatten()[: seq_lens[3]]
    key, value = randn(seq_lens[3], NUM_KV_HEADS, HEAD_DIM), randn(seq_lens[3], NUM_KV_HEADS, HEAD_DIM)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    ref.write_kv_cache(key, value, k_ref, v_ref, slots)
    record("write_kv_cache", k_cache, k_ref)
    qsl = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).int()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = randn(sum(q_lens), NUM_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    args = (query, k_cache, v_cache, qsl, sl, tables, scale)
    want = ref.paged_attention(*args)
    record("paged_attention (one chunk launch)", ops.paged_attention(*args), want)
    for splits in (1, 8):  # decodes first: the decode launch, then split-KV, with the chunks
        got = ops.paged_attention(*args, num_decodes=3, num_kv_splits=splits)
        record(f"paged_attention (decode + chunk launches, splits={splits})", got, want)
    return rows


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, counting the read and the write."""
    nbytes = 2 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def decode_floor(batch: int, ctx: int) -> float | None:
    """The issue's floor on % of copy bandwidth for decode attention, or None (no floor)."""
    if batch >= 16 and ctx >= 4096:
        return 85.0
    if batch == 1 and ctx == 4096:
        return 60.0
    return None


def verdict(measured: float, floor: float | None, higher_is_better: bool = True) -> str:
    if floor is None:
        return "-"
    ok = measured >= floor if higher_is_better else measured <= floor
    return "ok" if ok else "BELOW FLOOR"


def _decode_row(batch: int, ctx: int, gen: torch.Generator, copy_bw: float, sms: int) -> list[object]:
    """One decode configuration as the engine launches it; tensors freed on return."""
    from iterserve.kernels import ops

    scale = HEAD_DIM**-0.5
    k_cache, v_cache, tables = _paged_cache([ctx] * batch, gen)
    query = torch.randn((batch, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE, generator=gen)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    splits = ops.choose_num_splits(batch, NUM_KV_HEADS, ctx, sms)
    attention = partial(ops.paged_attention, query, k_cache, v_cache, qsl, seq_lens, tables, scale,
                        num_decodes=batch, num_kv_splits=splits)  # fmt: skip
    t_graph = _bench_graph(attention)
    t = t_graph if isinstance(t_graph, float) else _bench(attention)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    percent = 100 * kv_bytes / (t * 1e-3) / copy_bw
    sdpa = partial(
        torch.nn.functional.scaled_dot_product_attention,
        query[:, :, None, :],  # [S, Hq, 1, D]
        _contiguous(k_cache, tables, ctx),
        _contiguous(v_cache, tables, ctx),
        scale=scale,
        enable_gqa=True,
    )
    t_sdpa = _bench_baseline(sdpa)
    floor = decode_floor(batch, ctx)
    sdpa_note = f"dense SDPA {t_sdpa * 1e3:.0f} µs" if isinstance(t_sdpa, float) else f"SDPA {t_sdpa}"
    return [
        "decode attention",
        f"batch {batch} x ctx {ctx}, splits {splits}",
        f"{percent:.0f} % of copy BW ({t * 1e3:.0f} µs{'' if t is t_graph else ', no graph'}; {sdpa_note})",
        "-" if floor is None else f">= {floor:.0f} %",
        verdict(percent, floor),
    ]


def bench_decode(gen: torch.Generator, copy_bw: float, deadline: float) -> list[list[object]]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[list[object]] = []
    for ctx in CONTEXTS:
        for batch in BATCHES:
            if time.perf_counter() > deadline:
                rows.append(["decode attention", f"batch {batch} x ctx {ctx}", "skipped: time budget",
                             "-", "-"])  # fmt: skip
                continue
            rows.append(_decode_row(batch, ctx, gen, copy_bw, sms))
            torch.cuda.empty_cache()
            print(_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
    return rows


def _prefill_row(length: int, gen: torch.Generator) -> list[object]:
    from iterserve.kernels import ops

    scale = HEAD_DIM**-0.5
    k_cache, v_cache, tables = _paged_cache([length], gen)
    query = torch.randn((length, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE, generator=gen)
    qsl = torch.tensor([0, length], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    ours = partial(ops.paged_attention, query, k_cache, v_cache, qsl, seq_lens, tables, scale)
    sdpa = partial(
        torch.nn.functional.scaled_dot_product_attention,
        query.transpose(0, 1)[None],  # [1, Hq, L, D]
        _contiguous(k_cache, tables, length),
        _contiguous(v_cache, tables, length),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    t_ours, t_sdpa = _bench(ours), _bench_baseline(sdpa)
    # Causal: half of the L x L score matrix, two matmuls of 2 FLOP per multiply-add.
    flops = 4 * NUM_HEADS * HEAD_DIM * length * length / 2
    sdpa = f"SDPA {flops / (t_sdpa * 1e-3) / 1e12:.0f} TFLOPS" if isinstance(t_sdpa, float) else t_sdpa
    return ["prefill attention", f"one causal chunk of {length}",
            f"{flops / (t_ours * 1e-3) / 1e12:.0f} TFLOPS ({t_ours:.2f} ms)", sdpa, "-"]  # fmt: skip


HEADER = ["section", "case", "measured", "floor / reference", "verdict"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark iterserve's Triton kernels on a GPU.")
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    parser.add_argument("--skip-engine", action="store_true", help="kernels only")
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip decode rows past this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU; none is visible, nothing was run.", file=sys.stderr)
        return 2

    started = time.perf_counter()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    import triton

    title = (
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; "
        f"bf16, Hq={NUM_HEADS}, Hkv={NUM_KV_HEADS}, D={HEAD_DIM}, block size {BLOCK_SIZE}. Decode "
        "times are CUDA-graph replays (do_bench_cudagraph medians), others do_bench medians."
    )
    rows: list[list[object]] = []

    def save() -> None:
        # After every section, so a run cut short (device time, OOM) still leaves its numbers.
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(f"{title}\n\n{_table(HEADER, rows)}\n")

    for name, err, status in check_correctness(gen):
        rows.append(["bf16 correctness", name, f"max abs err {err}", "atol 1.5e-2, rtol 1e-2", status])
    save()
    copy_bw = copy_bandwidth()
    copy = f"{copy_bw / 1e9:.0f} GB/s (read + write)"
    rows.append(["memory ceiling", "device-to-device copy", copy, "-", "-"])
    save()
    engine_reserve = 0.0 if args.skip_engine else 120.0
    rows += bench_decode(gen, copy_bw, started + args.budget_s - engine_reserve)
    save()
    for length in PREFILL_LENS:
        rows.append(_prefill_row(length, gen))
        torch.cuda.empty_cache()
    save()
    if not args.skip_engine:
        from iterserve.loadtests.studies.gpu_first_light.engine_decode_bench import bench_engine_decode

        rows += bench_engine_decode(copy_bw)
    rows.append(["run", "total wall time", f"{time.perf_counter() - started:.0f} s", "< 300 s",
                 verdict(time.perf_counter() - started, 300.0, higher_is_better=False)])  # fmt: skip
    save()
    print(f"{title}\n\n{_table(HEADER, rows)}")
    failed = [f"{r[0]}: {r[1]}" for r in rows if r[4] in ("MISMATCH", "BELOW FLOOR")]
    if failed:
        print(f"FAILED: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
