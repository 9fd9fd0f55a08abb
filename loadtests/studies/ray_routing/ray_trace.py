"""A recorded trace as the Ray experiments' requests (`WorkloadRequest`s for `ray_harness.drive`).

    specs = trace_specs(*read_trace_turns(path), Vocabulary.of_engine(engine_kwargs),
                        time_scale=5.0)

The cluster simulator replays a trace with synthetic token ids (`sim/traces.py`); a real
engine takes ids inside its vocabulary, so each synthetic id is mapped to one there (a hash:
prompts that share a block still share it, and distinct blocks collide with negligible
chance). A chat's next turn holds its previous turn's answer: on the real path that is the
tokens the replica's simulated runner samples for the previous request, which are fixed by
its sampling seed (`ray_harness.request_seed`, `sim_runner.sim_output_tokens`), so the
replica's prefix cache finds the whole conversation, as the simulator's does.

Arrival times are multiplied by time_scale (the experiments slow the simulated GPU by it, so
the replay offers the same load as recorded) and divided by speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from iterserve.autoscale.sim.workload import WorkloadRequest
from iterserve.loadtests.studies.ray_harness import request_seed
from iterserve.replica.sim_runner import sim_output_tokens

FIRST_PROMPT_ID = 5  # below: ids a small vocabulary may reserve (pad, bos, eos, ...)
LONG_PROMPT_TOKENS = 1536  # kind "long" from here on, as routing_experiment's long requests
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Vocabulary:
    size: int
    eos_token_ids: frozenset[int]

    @classmethod
    def of_engine(cls, engine_kwargs: dict[str, Any]) -> Vocabulary:
        """The vocabulary and EOS ids of the engine these kwargs build (its model's)."""
        from iterserve.replica.config import EngineConfig
        from iterserve.replica.llm_engine import LLMEngine

        engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
        return cls(engine.runner.vocab_size, frozenset(engine.eos_token_ids))

    def map_token(self, token: int) -> int:
        """A synthetic token id as one of this vocabulary's, the same one every time."""
        x = (token * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64
        x = ((x ^ (x >> 29)) * 0xBF58476D1CE4E5B9) & _MASK64
        return FIRST_PROMPT_ID + (x ^ (x >> 32)) % (self.size - FIRST_PROMPT_ID)


def trace_specs(requests: Sequence[WorkloadRequest], parents: Sequence[int | None],
                vocabulary: Vocabulary, time_scale: float = 1.0, speed: float = 1.0
                ) -> list[WorkloadRequest]:
    """The trace's requests (`traces.read_trace_turns`) for a real engine: prompts
    in its vocabulary, a next turn holding its previous turn's prompt and real answer."""
    if not speed > 0 or not time_scale > 0:
        raise ValueError("time_scale and speed must be > 0")
    banned = frozenset(t for t in vocabulary.eos_token_ids if 0 <= t < vocabulary.size)
    prompts: list[list[int]] = []
    specs: list[WorkloadRequest] = []
    for i, (request, parent) in enumerate(zip(requests, parents, strict=True)):
        request_id = f"trace-{i}"
        own = request.prompt_token_ids
        if parent is None:
            prompt = [vocabulary.map_token(t) for t in own]
        else:
            previous = specs[parent]
            answer = sim_output_tokens(request_seed(previous.request_id), previous.max_tokens,
                                       vocabulary.size, banned)
            held = len(prompts[parent]) + len(answer)
            prompt = prompts[parent] + answer + [vocabulary.map_token(t) for t in own[held:]]
        prompts.append(prompt)
        kind = "long" if len(prompt) >= LONG_PROMPT_TOKENS else "short"
        specs.append(WorkloadRequest(request_id, request.arrival_time * time_scale / speed,
                                     prompt, request.max_tokens, kind=kind))
    return specs
