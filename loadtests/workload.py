"""The seeded workload on the command line: the flags `iterserve bench` shares, and a dump.

The requests come from `iterserve.autoscale.sim.workload.make_workload` (the one workload
model); this module is the command-line side of it::

    python -m iterserve.loadtests.workload --num-requests 8 --seed 0   # JSON lines on stdout
"""

from __future__ import annotations

import argparse
import json
import sys

from iterserve.autoscale.sim.workload import (
    DEFAULT_PROMPT_BUCKETS,
    OutputLengths,
    make_workload,
    parse_buckets,
    parse_output_lengths,
)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags every tool shares (bench, locust via env, this module's CLI)."""
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--prompt-buckets", type=parse_buckets, default=DEFAULT_PROMPT_BUCKETS,
                        help="name:low-high:weight,... (default short 16-64 0.5, medium "
                             "128-384 0.3, long 512-1024 0.2)")
    parser.add_argument("--output-lengths", type=parse_output_lengths,
                        default=OutputLengths(),
                        help="fixed:N | uniform:LO-HI | exponential:MEAN:LO-HI "
                             "(default exponential:128:8-512)")
    parser.add_argument("--vocab-size", type=int, default=4096,
                        help="prompt token ids are drawn below this")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16, help="how many requests")
    add_workload_arguments(parser)
    args = parser.parse_args(argv)
    for request in make_workload(args.num_requests, args.seed, prompt_buckets=args.prompt_buckets,
                                 output_lengths=args.output_lengths, vocab_size=args.vocab_size):
        print(json.dumps({"index": int(request.request_id), "bucket": request.kind,
                          "max_tokens": request.max_tokens,
                          "prompt_token_ids": request.prompt_token_ids}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
