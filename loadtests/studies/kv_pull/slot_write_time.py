"""How long the receiver's side of a pull takes in its first step: the pulled blocks written
into host slots, all at once (`HostKVTier.write_slots`) against block by block, one row copy
per layer tensor per block as it was before 38f045f; then copied on to the device as any host
hit is (`load`, for scale).

    python -m iterserve.loadtests.studies.kv_pull.slot_write_time [--blocks 31] [--reps 10]

SmolLM2-135M's KV layout (30 layers, 3 KV heads of 64, 16-token blocks, fp32: 737,280 bytes a
block), caches made as the CPU engine makes them (block-transposed K), one torch thread; the
payload rows read-only, as Ray's object store hands them out. Rounds alternate the two ways;
prints each round's medians in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from iterserve.replica.cpu_attention import CpuAttention
from iterserve.replica.host_kv_tier import HostKVTier

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def block_by_block(tier: HostKVTier, writes: list[tuple[int, np.ndarray]]) -> None:
    """The old write: each row to bytes, then to a bytearray, then one copy per layer tensor."""
    for slot, payload in writes:
        source = torch.frombuffer(bytearray(payload.tobytes()), dtype=torch.uint8)
        offset = 0
        for row in tier._rows(slot):
            row.copy_(source[offset : offset + row.numel()])
            offset += row.numel()


def median_ms(action: Callable[[], None], reps: int) -> float:
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=31, help="blocks a pull brings")
    parser.add_argument("--reps", type=int, default=10, help="writes per way and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the ways alternating")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device_blocks = args.blocks + 8
    attention = CpuAttention("sdpa", "blocks")
    caches = [attention.allocate(device_blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
              for _ in range(LAYERS)]
    for keys, values in caches:
        keys.copy_(torch.randn(keys.shape))
        values.copy_(torch.randn(values.shape))
    tier = HostKVTier(2 * args.blocks, caches)
    rows = np.stack([np.frombuffer(tier.read_device_block(caches, block), dtype=np.uint8)
                     for block in range(args.blocks)])
    rows.flags.writeable = False
    writes = list(zip(range(args.blocks, 2 * args.blocks), rows, strict=True))
    loads = [(slot, block) for block, (slot, _) in enumerate(writes)]
    print(f"{args.blocks} blocks, {rows.nbytes / 1e6:.1f} MB, 1 torch thread")
    ways = {"block by block": lambda: block_by_block(tier, writes),
            "write_slots": lambda: tier.write_slots(writes)}
    for round_index in range(args.rounds):
        order = list(ways) if round_index % 2 == 0 else list(ways)[::-1]
        figures = {name: median_ms(ways[name], args.reps) for name in order}
        load = median_ms(lambda: tier.load(caches, loads), args.reps)
        print(f"round {round_index}: " + ", ".join(f"{name} {figures[name]:.1f} ms"
                                                  for name in ways)
              + f"; then to the device (load) {load:.1f} ms")


if __name__ == "__main__":
    main()
