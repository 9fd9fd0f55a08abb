"""Per-request logit controls applied by the sampler after penalties, before temperature.

    logit_bias          OpenAI: add bias[t] to logit t (-100 bans, +100 forces in practice)
    allowed_token_ids   vLLM: every other token is masked
    bad_words           vLLM: a word's last token is masked when its other tokens end the output
    grammar             a token bitmask from the request's xgrammar matcher (structured_output)

A `RequestConstraint` lives on each (child) Request; requests without one are not looked at.
A row left with no allowed token is a dead end: the constraint records an error, the row
samples an arbitrary token, and the engine finishes that request alone with the error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from iterserve.replica.request import Request
    from iterserve.replica.structured_output import GrammarState


@dataclass
class RequestConstraint:
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    grammar: GrammarState | None = None
    error: str | None = None  # set on a dead end; the engine finishes the request with it
    _allowed_mask: torch.Tensor | None = field(default=None, repr=False)  # [V] bool

    def apply_logit_controls(self, row: torch.Tensor, output_token_ids: list[int]) -> None:
        """row: [V] float32 logits of this request, changed in place."""
        vocab = row.shape[0]
        if self.logit_bias:
            ids = torch.tensor([t for t, _ in self.logit_bias], device=row.device)
            row.index_add_(0, ids, torch.tensor([b for _, b in self.logit_bias],
                                                 dtype=row.dtype, device=row.device))
        if self.allowed_token_ids is not None:
            row.masked_fill_(~self._allowed(vocab, row.device), float("-inf"))
        banned = self._banned_by_bad_words(output_token_ids)
        if banned:
            row[banned] = float("-inf")

    def _allowed(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._allowed_mask is None or self._allowed_mask.device != device:
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            mask[list(self.allowed_token_ids or ())] = True
            self._allowed_mask = mask
        return self._allowed_mask

    def _banned_by_bad_words(self, output_token_ids: list[int]) -> list[int]:
        banned = []
        for word in self.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or output_token_ids[-len(prefix):] == prefix:
                banned.append(word[-1])
        return banned


def bad_words_token_ids(words: tuple[str, ...], encode: object) -> list[list[int]]:
    """vLLM's rule: each word as tokenized alone and after a space (mid-sentence form)."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = encode(text, add_special_tokens=False)  # type: ignore[operator]
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def apply_constraints(logits: torch.Tensor, requests: list[Request]) -> None:
    """logits: [S, V] float32, one row per request, changed in place. Free rows are skipped."""
    rows = [i for i, r in enumerate(requests) if r.constraint is not None]
    if not rows:
        return
    grammar_rows = []
    for i in rows:
        constraint = requests[i].constraint
        constraint.apply_logit_controls(logits[i], requests[i].output_token_ids)
        if constraint.grammar is not None:
            grammar_rows.append(i)
    if grammar_rows:
        from iterserve.replica.structured_output import apply_grammar_bitmasks

        apply_grammar_bitmasks(logits, grammar_rows,
                               [requests[i].constraint.grammar for i in grammar_rows])
    _flag_dead_ends(logits, rows, requests)


def _flag_dead_ends(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
    index = torch.tensor(rows, device=logits.device)
    alive = torch.isfinite(logits[index]).any(dim=-1).tolist()
    for i, ok in zip(rows, alive, strict=True):
        if ok:
            continue
        constraint = requests[i].constraint
        if constraint.grammar is not None and constraint.grammar.reallow_stop(logits[i]):
            continue  # min_tokens banned the only tokens a finished grammar allows: stop wins
        constraint.error = ("structured output dead end: no token is allowed by the "
                            "grammar and the logit controls together")
        logits[i] = 0.0  # sample something harmless; the engine discards the request
