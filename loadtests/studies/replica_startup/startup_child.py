"""One engine start in a fresh process, stage by stage, to its first token (startup_bench's
offline part runs this once per start, so every start pays its imports and reads).

    python -m iterserve.loadtests.studies.replica_startup.startup_child MODEL [--cpu-threads N]

Prints one JSON line: {"stages": {stage: {"seconds", "bytes_read", "bytes_copied"}},
"first_line": t, "first_token": t} on this machine's monotonic clock (CLOCK_MONOTONIC: one
clock for every process), so the parent adds the interpreter's own start (actor_start: spawn
to this module's first line) and checks that the stages sum to the wall time.
"""

from __future__ import annotations

import time

FIRST_LINE = time.monotonic()

import argparse  # noqa: E402 - after the first line's time stamp, on purpose
import json  # noqa: E402

from iterserve.replica.startup import StartupRecorder  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a .gguf file or an HF checkpoint folder")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads (a Serve replica on this 2-core box runs 1)")
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: fp32 on CPU)")
    args = parser.parse_args(argv)
    startup = StartupRecorder()
    with startup.stage("imports"):
        from iterserve.replica.config import EngineConfig
        from iterserve.replica.llm_engine import LLMEngine
        from iterserve.replica.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig.from_kwargs(model=args.model, cpu_threads=args.cpu_threads,
                                                dtype=args.dtype, device="cpu"))
    startup.merge(engine.startup)
    ready = time.monotonic()
    with startup.stage("first_token"):
        engine.add_request("Hello", SamplingParams(max_tokens=1, temperature=0.0))
        while not engine.step():
            pass
    print(json.dumps({"stages": startup.as_dict(), "first_line": FIRST_LINE, "ready": ready,
                      "first_token": time.monotonic()}), flush=True)


if __name__ == "__main__":
    main()
