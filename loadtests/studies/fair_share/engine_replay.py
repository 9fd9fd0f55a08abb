"""The noisy neighbour on one engine in virtual time: the engine's part of each tenant's TTFT,
free of the shared box's load. (README.md beside this file.)

The same workload as noisy_neighbour.py (tenant A at --a-rate, B at --b-rate, evenly spaced,
512 fresh random prompt tokens, 8 generated; A with a 2 s TTFT objective), the same engine
settings and simulated runner (prefill priced at 0.2 ms a token), but no HTTP and no Ray:
one LLMEngine stepped in a loop whose clock is virtual, advanced by exactly the cost model's
step time, so a run of 100 s takes seconds and gives the same figures on any machine. A
request arrives at its send time and is added when the step in flight ends (as the engine
thread takes commands); its TTFT is from its send time to the end of the step that sampled
its first token. The time outside the engine is a constant here (--outside-s, default 0:
noisy_neighbour.py measures it live).

    python -m iterserve.loadtests.studies.fair_share.engine_replay --policy fair
    python -m iterserve.loadtests.studies.fair_share.engine_replay --policy fair --a-rate 5
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from iterserve.autoscale.percentile import percentile
from iterserve.loadtests.studies.fair_share.noisy_neighbour import add_scenario_flags
from iterserve.replica.config import EngineConfig
from iterserve.replica.errors import SLOUnreachableError
from iterserve.replica.llm_engine import LLMEngine
from iterserve.replica.request import TenantShare
from iterserve.replica.runner_base import Runner
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.sim_runner import SimulatedRunner

HERE = Path(__file__).resolve().parent
SIMULATOR = '{"b_s_per_prefill_token": 0.0002}'  # noisy_neighbour.py's
PROMPT_TOKENS, MAX_TOKENS = 512, 8
ARRIVALS = ("even", "shifted", "poisson")


class VirtualClock:
    """Seconds that pass only when a simulated step sleeps (or the loop jumps ahead)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def now(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += max(0.0, seconds)


def virtual_engine(config: EngineConfig, clock: VirtualClock) -> LLMEngine:
    """An LLMEngine whose simulated runner sleeps and reads `clock`, as its scheduler does."""

    class VirtualTimeEngine(LLMEngine):
        @staticmethod
        def _build_runner(config: EngineConfig, model_path: Path, vocab_size: int) -> Runner:
            return SimulatedRunner(config, vocab_size, sleep_fn=clock.sleep, clock=clock.now)

    return VirtualTimeEngine(config, clock=clock.now)


def send_times(rates: dict[str, float], duration_s: float, arrivals: str,
               rng: random.Random) -> list[tuple[float, str]]:
    """Every (send time, tenant), in order, each tenant sending int(duration * rate):
    even: evenly spaced from 0 (noisy_neighbour.py's open loop; B's sends fall on A's);
    shifted: evenly spaced from a phase in [0, 1 / rate) drawn from `rng` per tenant (where
    B's requests land in A's steps, which the live run does not control);
    poisson: a Poisson process per tenant drawn from `rng` (bursts queue the baseline too)."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {arrivals!r}")
    sends = []
    for tenant, rate in rates.items():
        at = rng.uniform(0.0, 1.0 / rate) if arrivals == "shifted" else 0.0
        for i in range(int(duration_s * rate)):
            if arrivals == "poisson":
                at += rng.expovariate(rate)
            sends.append((at if arrivals == "poisson" else at + i / rate, tenant))
    return sorted(sends)


def replay(policy: str, rates: dict[str, float], a_slo_ms: float, budget: int,
           duration_s: float, outside_s: float, arrivals: str = "even", seed: int = 7,
           fair_prefill_share: bool = True) -> dict[str, Any]:
    clock = VirtualClock()
    engine = virtual_engine(EngineConfig.from_kwargs(
        runner="simulated", model="iterserve-tiny", device="cpu", simulator=SIMULATOR,
        scheduler_policy=policy, max_num_seqs=16, max_num_batched_tokens=budget,
        num_gpu_blocks_override=4096, max_model_len=1024,
        fair_prefill_share=fair_prefill_share), clock)
    shares = {"a": TenantShare("a", 1.0, a_slo_ms, outside_s), "b": TenantShare("b", 1.0)}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    sends = send_times(rates, duration_s, arrivals, rng)
    sent: dict[str, tuple[str, float]] = {}
    ttfts: dict[str, list[float]] = {tenant: [] for tenant in rates}
    refused = dict.fromkeys(rates, 0)
    next_send = steps = 0
    while next_send < len(sends) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and clock.now_s < sends[next_send][0]:
            clock.now_s = sends[next_send][0]  # idle until the next arrival
        while next_send < len(sends) and sends[next_send][0] <= clock.now_s:
            at, tenant = sends[next_send]
            next_send += 1
            prompt = [rng.randrange(100, 4000) for _ in range(PROMPT_TOKENS)]
            try:
                request_id = engine.add_request(prompt, params, tenant=shares[tenant],
                                                arrival_time=at)
            except SLOUnreachableError:
                refused[tenant] += 1
                continue
            sent[request_id] = (tenant, at)
        steps += 1
        for output in engine.step():
            if output.request_id in sent and output.new_token_ids:
                tenant, at = sent.pop(output.request_id)
                ttfts[tenant].append(clock.now_s - at + outside_s)
    summary: dict[str, Any] = {"policy": policy, "max_num_batched_tokens": budget,
                               "fair_prefill_share": fair_prefill_share, "rates": rates,
                               "arrivals": arrivals, "seed": seed, "a_slo_ms": a_slo_ms,
                               "outside_s": outside_s, "duration_s": duration_s,
                               "steps": steps, "virtual_s": round(clock.now_s, 3),
                               "served_per_virtual_s": round(
                                   sum(map(len, ttfts.values())) / clock.now_s, 3)}
    for tenant, values in ttfts.items():
        values.sort()
        summary[tenant] = {
            "served": len(values), "refused_429": refused[tenant],
            "refusal_rate": round(refused[tenant] / max(1, int(duration_s * rates[tenant])), 3),
            "within_a_slo": round(sum(v <= a_slo_ms / 1000 for v in values)
                                  / max(1, len(values)), 3),
            **{f"ttft_p{q}_s": round(percentile(values, q), 3) for q in (50, 90, 99)},
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_scenario_flags(parser)
    parser.add_argument("--outside-s", type=float, default=0.0,
                        help="seconds outside the engine added to every TTFT")
    parser.add_argument("--arrivals", choices=ARRIVALS, default="even",
                        help="evenly spaced sends (as noisy_neighbour.py), evenly spaced "
                        "from a phase drawn per tenant from --seed, or Poisson")
    parser.add_argument("--seed", type=int, default=7,
                        help="the random prompts and, with --arrivals shifted or poisson, the "
                        "send times")
    parser.add_argument("--no-fair-prefill-share", dest="fair_prefill_share",
                        action="store_false", help="the engine's fair_prefill_share off")
    parser.add_argument("--out", type=Path, default=None, help="results file (default: "
                        "results/replay_<policy>_a<rate>_b<budget>.json)")
    args = parser.parse_args(argv)
    summary = replay(args.policy, {"a": args.a_rate, "b": args.b_rate}, args.a_slo_ms,
                     args.max_num_batched_tokens, args.duration, args.outside_s,
                     args.arrivals, args.seed, args.fair_prefill_share)
    out = args.out or HERE / "results" / (f"replay_{args.policy}_a{args.a_rate:g}"
                                          f"_b{args.max_num_batched_tokens}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
