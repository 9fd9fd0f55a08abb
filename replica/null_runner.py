"""A runner that computes nothing: deterministic tokens, no model, no sleep.

For scheduler tests and the scheduler-overhead benchmark: everything above the runner runs
for real while the device costs nothing. Token t of a request is a hash of its prompt
length and position, so outputs are the same however requests are batched or preempted.
"""

from __future__ import annotations

from iterserve.replica.outputs import RunnerOutput, SchedulerOutput


class NullRunner:
    def __init__(self, num_blocks: int, vocab_size: int = 1000, eos_token_id: int | None = None,
                 eos_every: int = 0) -> None:
        self.vocab_size = vocab_size
        self._num_blocks = num_blocks
        self.eos_token_id = eos_token_id
        self.eos_every = eos_every  # emit EOS at every eos_every-th position (0: never)

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def release(self, request_id: str) -> None:
        return None

    def token_for(self, prompt_len: int, position: int, first_token: int) -> int:
        if self.eos_every and self.eos_token_id is not None and (position + 1) % self.eos_every == 0:
            return self.eos_token_id
        return (prompt_len * 7919 + position * 104729 + first_token) % self.vocab_size

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        output = RunnerOutput()
        for s in scheduler_output.scheduled:
            if s.samples:
                request = s.request
                position = s.num_computed_tokens + s.num_new_tokens  # of the sampled token
                output.sampled_token_ids[request.request_id] = self.token_for(
                    request.num_prompt_tokens, position, request.prompt_token_ids[0]
                )
        return output
