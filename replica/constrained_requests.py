"""The engine's side of constrained requests: attach constraints, hold requests until their
grammar is compiled, and advance matchers with each sampled token.

Requests whose grammar is compiling wait here, before the scheduler, so a slow compile never
occupies a batch slot or KV blocks; they count as waiting in the engine's stats. xgrammar is
imported only when the first grammar arrives.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING

from iterserve.replica.logit_controls import RequestConstraint, bad_words_token_ids
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams
from iterserve.replica.tokenizer import Tokenizer

if TYPE_CHECKING:
    from iterserve.replica.structured_output import GrammarCompilerPool

Held = tuple[concurrent.futures.Future, list[Request]]


class ConstrainedRequests:
    def __init__(self, tokenizer: Tokenizer, logits_width: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.logits_width = logits_width
        self.stop_token_ids = sorted(stop_token_ids)
        self._pool: GrammarCompilerPool | None = None
        self.held: dict[str, Held] = {}  # parent id -> (compile future, children)

    @property
    def pool(self) -> GrammarCompilerPool:
        if self._pool is None:
            from iterserve.replica.structured_output import GrammarCompilerPool, tokenizer_info

            info = tokenizer_info(self.tokenizer, self.logits_width, self.stop_token_ids)
            self._pool = GrammarCompilerPool(info)
        return self._pool

    # ------------------------------------------------------------------------ admission
    def check(self, params: SamplingParams) -> None:
        """Token ids the model cannot produce are bad input (ValueError -> 400)."""
        ids = [t for t, _ in params.logit_bias] + list(params.allowed_token_ids or ())
        bad = [t for t in ids if t >= self.logits_width]
        if bad:
            raise ValueError(f"token ids in logit_bias / allowed_token_ids must be < the "
                             f"vocabulary size {self.logits_width}; got {bad[:5]}")

    def attach(self, children: list[Request], params: SamplingParams) -> bool:
        """Give each child its constraint; True when they must wait for a grammar."""
        if not params.has_constraint:
            return False
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer.encode)
        for child in children:
            child.constraint = RequestConstraint(
                logit_bias=params.logit_bias, allowed_token_ids=params.allowed_token_ids,
                bad_words_token_ids=bad_words)
        return params.structured is not None

    def hold(self, parent_id: str, children: list[Request]) -> None:
        spec = children[0].sampling_params.structured
        self.held[parent_id] = (self.pool.compile(spec), children)

    @property
    def num_held(self) -> int:
        return sum(len(children) for _, children in self.held.values())

    def release(self, parent_id: str) -> list[Request]:
        """Forget a held request (aborted); returns its children."""
        held = self.held.pop(parent_id, None)
        return held[1] if held else []

    def wait_for_any(self, timeout_s: float) -> None:
        """Block briefly when held requests are all the engine has (no busy loop)."""
        futures = [future for future, _ in self.held.values()]
        concurrent.futures.wait(futures, timeout=timeout_s,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def take_compiled(self) -> list[tuple[str, list[Request], str | None]]:
        """Held requests whose grammar is done: (parent id, children, compile error or None).
        On success each child has its own matcher (n > 1: one matcher per child)."""
        from iterserve.replica.structured_output import GrammarState

        ready = []
        for parent_id, (future, children) in list(self.held.items()):
            if not future.done():
                continue
            del self.held[parent_id]
            error = future.exception()
            if error is not None:
                ready.append((parent_id, children, str(error)))
                continue
            for child in children:
                state = GrammarState(future.result(), self._stop_ids(child))
                child.constraint.grammar = state
                if state.dead_end:
                    child.constraint.error = "structured output: the grammar allows no token"
            ready.append((parent_id, children, None))
        return ready

    def _stop_ids(self, request: Request) -> list[int]:
        params = request.sampling_params
        ids = set(params.stop_token_ids) | set(params.extra_eos_token_ids)
        if not params.ignore_eos:
            ids |= set(request.eos_token_ids)
        return sorted(t for t in ids if t < self.logits_width)

    # --------------------------------------------------------------------------- decode
    @staticmethod
    def advance(updated: list[Request]) -> tuple[list[Request], list[Request]]:
        """Feed each constrained request its newest token. Returns (dead ends, grammars that
        accepted their stop token); the caller finishes both."""
        dead, complete = [], []
        for request in updated:
            constraint = request.constraint
            if constraint is None:
                continue
            if constraint.error is None and constraint.grammar is not None:
                constraint.error = constraint.grammar.accept(request.output_token_ids[-1])
                if constraint.error is None and constraint.grammar.is_terminated:
                    complete.append(request)
            if constraint.error is not None:
                dead.append(request)
        return dead, complete

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
