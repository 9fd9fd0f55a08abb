"""The cluster simulator's named workload shapes (`simulate`, `tournament`, `iterserve plan`).

Each generator takes (rate, duration_s, seed) - rate is the mean request arrival rate per
second over the run - and returns `WorkloadRequest`s sorted by arrival (their times from
`arrivals.py`). Same arguments, same requests. Names for `--workload`:

    steady           Poisson arrivals, mixed prompt lengths
    skewed-bursts    the routing experiment's shape: a Poisson base plus periodic bursts,
                     a quarter long requests, 60 % starting with one of 6 Zipf-popular
                     system prompts
    diurnal          a slow ramp (0.5x -> 1.2x of rate) with a spike to 3x the base rate
                     reached within 10 s, 2/3 of the way through
    multi-tenant     150 tenants, each a 6k-token shared context plus 1-2k-token questions,
                     Zipf-popular tenants (llm-d's shared-prefix benchmark shape)
    multi-turn       chat sessions whose prompt grows every turn by the last answer and a
                     new message (the answer's tokens are what the simulator generates)
    chat-summarise   80 % short chat, 20 % long-document summarisation
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from iterserve.autoscale.sim.arrivals import poisson_times, thinned_times
from iterserve.autoscale.sim.prompts import SyntheticPrompt, unique_start
from iterserve.autoscale.sim.workload import WorkloadRequest

VOCAB = (16, 32000)  # token ids drawn from [16, 32000): a Llama-sized vocabulary
Generator = Callable[[float, float, int], list[WorkloadRequest]]


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    lo, hi = VOCAB
    return tuple(rng.randrange(lo, hi) for _ in range(n))


def _prompt(i: int, head: tuple[int, ...], num_unique: int, private: bool = True
            ) -> SyntheticPrompt:
    """Request i's prompt: a shared head, then tokens no other request of the run has.
    private: nor does any other prompt repeat them (False where a later prompt's head
    does: a chat's next turn)."""
    return SyntheticPrompt(head, unique_start(i), num_unique, private)


def _request(i: int, t: float, prompt: Sequence[int], max_tokens: int, rng: random.Random,
             name: str, session: str | None = None, tenant: str | None = None
             ) -> WorkloadRequest:
    return WorkloadRequest(f"{name}-{i}", t, prompt, max_tokens, session,
                           output_token_id=rng.randrange(*VOCAB), tenant=tenant)


def steady(rate: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(f"steady/{seed}")
    out = []
    for i, t in enumerate(poisson_times(rng, rate, duration_s)):
        prompt = _prompt(i, (), rng.choice([rng.randint(64, 512), rng.randint(512, 2048)]))
        out.append(_request(i, t, prompt, rng.randint(32, 384), rng, "steady"))
    return out


def skewed_bursts(rate: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    """Base Poisson at 0.6 x rate plus bursts every 12 s carrying the other 0.4 x rate."""
    rng = random.Random(f"bursts/{seed}")
    prefixes = [_tokens(rng, 256) for _ in range(6)]
    zipf = [1.0 / (k + 1) for k in range(6)]
    times = poisson_times(rng, 0.6 * rate, duration_s)
    period, burst_len = 12.0, 1.0
    per_burst = max(1, round(0.4 * rate * period))
    for start in range(int(duration_s // period)):
        times += [start * period + rng.uniform(0, burst_len) for _ in range(per_burst)]
    out = []
    for i, t in enumerate(sorted(times)):
        long = rng.random() < 0.25
        body = rng.randint(1536, 3072) if long else rng.randint(64, 384)
        out_tokens = rng.randint(128, 384) if long else rng.randint(16, 128)
        head = rng.choices(prefixes, weights=zipf)[0] if rng.random() < 0.6 else ()
        out.append(_request(i, t, _prompt(i, head, body), out_tokens, rng, "bursts"))
    return out


def diurnal(rate: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    """Rate ramps 0.5x -> 1.2x; at 2/3 of the run it climbs to 3x within 10 s, holds 30 s."""
    rng = random.Random(f"diurnal/{seed}")
    spike_at = duration_s * 2 / 3

    def shape(t: float) -> float:  # relative to the 3x peak
        base = 0.5 + 0.7 * (t / duration_s)
        if spike_at <= t < spike_at + 40.0:
            climb = min(1.0, (t - spike_at) / 10.0)
            base = base + (3.0 - base) * climb
        return base / 3.0

    out = []
    for i, t in enumerate(thinned_times(rng, 3.0 * rate, duration_s, shape)):
        prompt = _prompt(i, (), rng.randint(128, 1536))
        out.append(_request(i, t, prompt, rng.randint(32, 256), rng, "diurnal"))
    return out


def multi_tenant(rate: float, duration_s: float, seed: int = 0, tenants: int = 150,
                 context_tokens: int = 6000) -> list[WorkloadRequest]:
    rng = random.Random(f"tenants/{seed}")
    # Tenant k's context: ids of its own below the requests' own (2^31+) and the vocabulary.
    contexts = [tuple(range((1 << 29) + k * (1 << 16), (1 << 29) + k * (1 << 16)
                            + context_tokens)) for k in range(tenants)]
    zipf = [1.0 / (k + 1) ** 0.8 for k in range(tenants)]
    out = []
    for i, t in enumerate(poisson_times(rng, rate, duration_s)):
        tenant = rng.choices(range(tenants), weights=zipf)[0]
        prompt = _prompt(i, contexts[tenant], rng.randint(1000, 2000))
        out.append(_request(i, t, prompt, rng.randint(64, 256), rng, "tenants",
                            f"tenant-{tenant}", tenant=f"tenant-{tenant}"))
    return out


def multi_turn(rate: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    """Sessions start at rate / 4 per second; each has 2-6 turns ~8 s apart (4 turns mean)."""
    rng = random.Random(f"turns/{seed}")
    out: list[WorkloadRequest] = []
    for s, start in enumerate(poisson_times(rng, rate / 4.0, duration_s)):
        history: tuple[int, ...] = ()
        message = rng.randint(200, 800)  # system prompt + first message
        t = start
        for _ in range(rng.randint(2, 6)):
            if t >= duration_s or len(history) + message > 7000:
                break
            i = len(out)
            answer = rng.randint(64, 320)
            prompt = _prompt(i, history, message, private=False)  # the next turn holds it
            request = _request(i, t, prompt, answer, rng, "turns", f"session-{s}")
            out.append(request)
            history = tuple(prompt) + (request.output_token_id,) * answer
            message = rng.randint(30, 200)
            t += 1.0 + rng.expovariate(1 / 7.0)
    out.sort(key=lambda r: r.arrival_time)
    return out


def chat_summarise(rate: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(f"mix/{seed}")
    out = []
    for i, t in enumerate(poisson_times(rng, rate, duration_s)):
        if rng.random() < 0.2:
            prompt, answer = _prompt(i, (), rng.randint(3000, 7000)), rng.randint(200, 500)
        else:
            prompt, answer = _prompt(i, (), rng.randint(50, 500)), rng.randint(30, 300)
        out.append(_request(i, t, prompt, answer, rng, "mix"))
    return out


WORKLOADS: dict[str, Generator] = {
    "steady": steady,
    "skewed-bursts": skewed_bursts,
    "diurnal": diurnal,
    "multi-tenant": multi_tenant,
    "multi-turn": multi_turn,
    "chat-summarise": chat_summarise,
}


def make(name: str, rate: float, duration_s: float, seed: int = 0) -> list[WorkloadRequest]:
    try:
        generator = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of "
                         f"{', '.join(WORKLOADS)}") from None
    requests = generator(rate, duration_s, seed)
    if not requests or math.isnan(requests[-1].arrival_time):
        raise ValueError(f"workload {name!r} at rate {rate} over {duration_s}s is empty")
    return requests
