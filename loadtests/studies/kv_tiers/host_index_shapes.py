"""The host tier's eviction (replica/host_kv_index.py) replayed over several workload shapes.

    python -m iterserve.loadtests.studies.kv_tiers.host_index_shapes \
        [--policies lru,arc,slru,slru:0.2]

Pure Python on the real HostKVIndex and its eviction policies (replica/host_kv_eviction.py): a
device prefix cache of LRU blocks in front of it (what the device evicts is stored in the
tier), one request at a time, no model. Prints, per policy (slru:F is the segmented LRU with a
protected share F of the tier) and per shape, the share of the reused blocks found (the device
or the tier) in each phase; each phase brings new chats or documents, so a phase change is
what a new set of users looks like to the tier. Shapes:

  chat C x B, T turns  C chats of a B-block first prompt, then T returning turns each adding
                       9 blocks, round-robin (the HTTP study's shape is 6 x 128, 3 turns);
  + scan S             S blocks of a prompt never seen again after every turn (no reuse);
  rag D x B, zipf z    D documents of B blocks, Zipf(z) popularity, 4 fresh question blocks
                       each; a document's later visits are the reuse.

The HTTP study (README, "Over HTTP") sized the device at 234 blocks and the tier at 936, the
chats' working set; those are the defaults here.
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict
from collections.abc import Callable, Hashable

from iterserve.replica.host_kv_eviction import (
    EvictionPolicy,
    SegmentedLRUEviction,
    make_eviction_policy,
)
from iterserve.replica.host_kv_index import HostEntry, HostKVIndex

Lookup = Callable[[Hashable], bool]


def device_in_front_of(index: HostKVIndex, device_blocks: int) -> Lookup:
    """A lookup through an LRU device cache of `device_blocks`, then the tier; every block
    the device evicts is stored in the tier. True when the block was found in either."""
    device: OrderedDict[Hashable, None] = OrderedDict()

    def cached(key: Hashable) -> bool:
        if key in device:
            device.move_to_end(key)
            return True
        slot = index.lookup(key)  # type: ignore[arg-type]
        if slot is not None:
            index.record_hit(slot)
            index.unpin_all()
        device[key] = None
        while len(device) > device_blocks:
            evicted, _ = device.popitem(last=False)
            index.store(HostEntry(evicted, evicted, ()))  # type: ignore[arg-type]
            index.unpin_all()
        return slot is not None

    return cached


def chat_hit_rates(cached: Lookup, chats: int, blocks: int, turns: int, phases: int,
                   scan: int = 0) -> list[float]:
    """Per phase, the share of returning turns' history blocks found cached."""
    rates, scanned = [], 0
    for phase in range(phases):
        histories = [[(phase, chat, block) for block in range(blocks)] for chat in range(chats)]
        found = looked_up = 0
        for turn in range(turns + 1):
            for chat, history in enumerate(histories):
                hits = [cached(key) for key in history]
                if turn > 0:  # the 9 blocks the last turn added were never computed before
                    found += sum(hits[:-9])
                    looked_up += len(history) - 9
                history += [(phase, chat, len(history) + i) for i in range(9)]
                for _ in range(scan):
                    scanned += 1
                    cached(("scan", scanned))
        rates.append(found / looked_up)
    return rates


def rag_hit_rates(cached: Lookup, documents: int, blocks: int, requests: int, zipf: float,
                  phases: int, seed: int = 0) -> list[float]:
    """Per phase, the share of revisited documents' blocks found cached."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** zipf for rank in range(documents)]
    rates, questions = [], 0
    for phase in range(phases):
        seen: set[int] = set()
        found = looked_up = 0
        for _ in range(requests):
            doc = rng.choices(range(documents), weights)[0]
            hits = [cached((phase, "doc", doc, block)) for block in range(blocks)]
            questions += 1
            for block in range(4):
                cached(("question", questions, block))
            if doc in seen:
                found += sum(hits)
                looked_up += blocks
            seen.add(doc)
        rates.append(found / max(1, looked_up))
    return rates


SHAPES: dict[str, Callable[[Lookup], list[float]]] = {
    "chat 6 x 128, 3 turns (the HTTP study)": lambda c: chat_hit_rates(c, 6, 128, 3, 3),
    "chat 8 x 96, 3 turns": lambda c: chat_hit_rates(c, 8, 96, 3, 3),
    "chat 4 x 200, 3 turns": lambda c: chat_hit_rates(c, 4, 200, 3, 3),
    "chat 12 x 64, 6 turns (working set 1.5x the tier)": lambda c: chat_hit_rates(c, 12, 64, 6, 3),
    "chat 6 x 128 + scan 64": lambda c: chat_hit_rates(c, 6, 128, 3, 3, scan=64),
    "rag 9 x 96, zipf 0.6": lambda c: rag_hit_rates(c, 9, 96, 60, 0.6, 3),
    "rag 30 x 64, zipf 1.0": lambda c: rag_hit_rates(c, 30, 64, 120, 1.0, 3),
}


def policy_named(label: str, num_slots: int) -> EvictionPolicy:
    """lru, arc, slru (the setting's names), or slru:F for a segmented LRU protecting F."""
    name, _, fraction = label.partition(":")
    if name == "slru" and fraction:
        return SegmentedLRUEviction(num_slots, float(fraction))
    return make_eviction_policy(name, num_slots)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default="lru,arc,slru,slru:0.2",
                        help="comma-separated eviction policies to replay (slru:F: a segmented "
                        "LRU whose protected segment holds at most F of the tier)")
    parser.add_argument("--device-blocks", type=int, default=234, help="device KV blocks")
    parser.add_argument("--host-slots", type=int, default=936, help="host tier slots")
    args = parser.parse_args(argv)
    labels = args.policies.split(",")
    print("| shape | " + " | ".join(f"{label}: hit share per phase" for label in labels) + " |")
    print("|---|" + "---|" * len(labels))
    for name, shape in SHAPES.items():
        cells = []
        for label in labels:
            index = HostKVIndex(args.host_slots, policy_named(label, args.host_slots))
            rates = shape(device_in_front_of(index, args.device_blocks))
            cells.append(" / ".join(f"{rate:.2f}" for rate in rates))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
