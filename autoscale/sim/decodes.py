"""The decoding requests of a simulated replica, advanced lazily (the fast path).

A request that is running with exactly one uncomputed token is a decode: every step until
it finishes computes one token and samples one. Nothing about that needs per-step work
except three kinds of moments:
    ALLOC     the schedule() of step s takes a new block for it (its KV passes a block),
    REGISTER  the update() of step s completes a block: it joins the prefix cache,
    FINISH    the update() of step s samples its last token (max_tokens / max_model_len).
ALLOC and REGISTER recur every block_size steps, so the cohort keeps them in block_size
buckets by step modulo block_size (each bucket in admission order; no heap operation per
event); FINISH, once per member, in a heap keyed by step.
Its `Request` fields (num_computed_tokens, output_token_ids, token_times) are brought up
to date only at those moments and when someone needs them (`materialise`). The block
manager is always exact: blocks are taken and registered at the step and in the order the
per-step scheduler would (decodes in running order, which is admission order `seq`).
"""

from __future__ import annotations

import bisect
import heapq
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from iterserve.autoscale.sim.block_manager import SimBlockManager
from iterserve.replica.block_keys import BlockTokens, block_tokens
from iterserve.replica.request import Request


@dataclass(eq=False)
class Decoder:
    request: Request
    seq: int  # admission order: the order of the scheduler's running list
    join_step: int  # the last step whose update left it with one uncomputed token
    computed0: int  # its num_computed_tokens then
    outputs0: int  # its num_output_tokens then
    finish_step: int
    token: int  # what it samples at every position
    run: BlockTokens = b""  # a block of that token, in block_tokens form
    prompt_len: int = 0  # len(request.prompt_token_ids), read at every block it fills
    alloc_from: int = 0  # its first ALLOC step (then every block_size steps)
    register_from: int = 0  # its first REGISTER step (then every block_size steps)
    registers: bool = True  # False: the blocks it fills are private (no REGISTER events)

    def computed_after(self, step: int) -> int:
        return self.computed0 + step - self.join_step


class DecodeCohort:
    def __init__(self, block_manager: SimBlockManager, max_model_len: int) -> None:
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.members: dict[str, Decoder] = {}
        size = block_manager.block_size
        self._allocs: list[list[Decoder]] = [[] for _ in range(size)]  # by step % size
        self._registers: list[list[Decoder]] = [[] for _ in range(size)]
        self._finishes: list[tuple[int, int, str]] = []  # (step, seq, id) heap
        self.kv_base = 0  # sum of (computed0 - join_step): step s reads kv_base + n * s
        self._short: list[Decoder] = []  # joined with their last prompt token uncomputed

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.members

    def kv_tokens_read(self, step: int) -> int:
        """KV tokens the decodes read in step `step` (each: its computed tokens + 1)."""
        return self.kv_base + len(self.members) * step

    # ------------------------------------------------------------------ membership
    def join(self, request: Request, seq: int, step: int, token: int,
             private_from: int | None = None) -> None:
        """After step `step`'s update left `request` with one uncomputed token.
        private_from: the block manager's `mark_private` block for it, if any: the blocks
        from there on are not registered as they fill."""
        block_size = self.block_manager.block_size
        c0 = request.num_computed_tokens
        params = request.sampling_params
        left = min(params.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens)
        member = Decoder(request, seq, step, c0, request.num_output_tokens, step + left, token,
                         block_tokens((token,) * block_size), len(request.prompt_token_ids))
        rid = request.request_id
        self.members[rid] = member
        if c0 < member.prompt_len:
            self._short.append(member)
        self.kv_base += c0 - step
        capacity = len(self.block_manager.block_tables[rid]) * block_size
        member.alloc_from = step + 1 + capacity - c0
        member.register_from = step + block_size - c0 % block_size
        member.registers = private_from is None or c0 // block_size < private_from
        bisect.insort(self._allocs[member.alloc_from % block_size], member, key=_admission)
        if member.registers:
            bisect.insort(self._registers[member.register_from % block_size], member,
                          key=_admission)
        heapq.heappush(self._finishes, (member.finish_step, seq, rid))

    def leave(self, request_id: str, step: int) -> Request:
        """Remove a member, its fields made current as of the end of step `step`."""
        member = self.members.pop(request_id)
        size = self.block_manager.block_size
        self._allocs[member.alloc_from % size].remove(member)
        if member.registers:
            self._registers[member.register_from % size].remove(member)
        self.kv_base -= member.computed0 - member.join_step
        self.materialise(member, step)
        return member.request

    def materialise(self, member: Decoder, step: int, step_ends: Sequence[float] | None = None
                    ) -> None:
        """Bring the request's fields to the end of step `step` (token times from step_ends,
        the replica's end time of every step, when given)."""
        request = member.request
        request.num_computed_tokens = member.computed_after(step)
        want = member.outputs0 + step - member.join_step
        have = request.num_output_tokens
        if want > have:
            request.output_token_ids.extend([member.token] * (want - have))
        if step_ends is not None and want > 0:
            if request.first_token_time is None:  # joined with its last prompt token left
                request.first_token_time = step_ends[member.join_step]
            have_times = len(request.token_times)
            if want > have_times:
                first = step - (want - have_times)  # steps first+1..step are missing
                request.token_times.extend(step_ends[first:step])

    def sync_computed(self, step: int) -> None:
        """num_computed_tokens as of the end of step `step` for the members whose prompt
        tokens a stats report counts (`Scheduler.num_queued_prefill_tokens`): those that
        joined with their last prompt token uncomputed, which the step after computes (the
        others' lazily kept count already covers their prompt)."""
        if not self._short:
            return
        members, still_short = self.members, []
        for member in self._short:
            if members.get(member.request.request_id) is member:
                member.request.num_computed_tokens = member.computed_after(step)
                if step == member.join_step:
                    still_short.append(member)
        self._short = still_short

    def all_members(self) -> Iterator[Decoder]:
        return iter(sorted(self.members.values(), key=lambda m: m.seq))

    def clear(self) -> None:
        self.members.clear()
        for bucket in self._allocs + self._registers:
            bucket.clear()
        self._finishes.clear()
        self._short.clear()
        self.kv_base = 0

    # ---------------------------------------------------------------------- events
    def due_allocs(self, step: int) -> list[Decoder]:
        """The members whose schedule() of step `step` takes a block, in admission order."""
        return [m for m in self._allocs[step % self.block_manager.block_size]
                if m.alloc_from <= step]

    def due_registers(self, step: int) -> list[Decoder]:
        """The members whose update() of step `step` completes a block, in admission
        order (before any FINISH of the step: a member registers before it finishes)."""
        return [m for m in self._registers[step % self.block_manager.block_size]
                if m.register_from <= step]

    def due_finishes(self, step: int) -> list[Decoder]:
        """The members that sample their last token in step `step`, in admission order."""
        finishes = self._finishes
        out = []
        while finishes and finishes[0][0] == step:
            _, seq, rid = heapq.heappop(finishes)
            member = self.members.get(rid)
            if member is not None and member.seq == seq:
                out.append(member)
        return out  # the heap pops (step, seq) in order


_admission = operator.attrgetter("seq")

