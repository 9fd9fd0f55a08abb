"""Turn the last-position logits of a batch into one token per request.

Order of operations, as in vLLM: penalties (repetition on prompt + output, frequency and
presence on output) -> min_tokens masking of stop tokens -> logprobs (of the penalised
distribution, before temperature) -> greedy argmax, or temperature, top_k, top_p, min_p and
a draw from the request's own generator. A request with a seed owns a torch.Generator, so its
samples do not depend on which requests share its batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from iterserve.replica.errors import is_device_fault
from iterserve.replica.outputs import TokenLogprobs
from iterserve.replica.request import Request
from iterserve.replica.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.default_generator
        generator = self.generators.get(request.request_id)
        if generator is None:
            # Children of one n > 1 request draw different samples from one seed.
            generator = torch.Generator(device=self.device).manual_seed(seed + request.index)
            self.generators[request.request_id] = generator
        return generator

    def sample(
        self,
        logits: torch.Tensor,  # [S, V] float32, one row per sampling request
        requests: list[Request],
    ) -> tuple[list[int], list[TokenLogprobs | None], dict[int, str]]:
        """One token per row, its logprobs, and the rows whose own work raised.

        A failed row (row -> what went wrong) has no token: its request ends alone with an
        error while the other rows' tokens stand. A device fault is re-raised (see
        `is_device_fault`): it is the whole step's, not one request's.
        """
        token_ids, log_probs, want_logprobs, failed = self.choose_tokens(logits, requests)
        chosen = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        for k, row in enumerate(want_logprobs):
            if row not in failed:
                with _row_of(failed, row):
                    num_top = requests[row].sampling_params.logprobs or 0
                    logprobs[row] = _token_logprobs(log_probs[k], chosen[row], num_top)
        return chosen, logprobs, failed

    def choose_tokens(
        self,
        logits: torch.Tensor,  # [S, V] float32, one row per sampling request
        requests: list[Request],
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int], dict[int, str]]:
        """The sampled ids [S], the log-probabilities [W, V] of the W rows that asked for
        logprobs, those rows, and the rows whose own work raised. The tensors stay on the
        device: nothing here waits for the GPU (async scheduling copies them to the host
        later), except the penalties' and min_tokens' index lists."""
        logits = logits.float()
        failed: dict[int, str] = {}
        for row, request in enumerate(requests):
            with _row_of(failed, row):
                self._apply_penalties(logits[row], request)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.is_greedy]
        if len(greedy_rows) == len(requests):
            token_ids = logits.argmax(dim=-1)  # [S]
        else:
            token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
            if greedy_rows:
                rows = index_on_device(greedy_rows, logits.device)
                token_ids[rows] = logits[rows].argmax(dim=-1)
        want_logprobs = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        log_probs = (torch.log_softmax(logits[index_on_device(want_logprobs, logits.device)], dim=-1)
                     if want_logprobs else None)
        for row, request in enumerate(requests):
            if not request.sampling_params.is_greedy and row not in failed:
                with _row_of(failed, row):
                    token_ids[row] = self._draw(logits[row], request)
        return token_ids, log_probs, want_logprobs, failed

    def _apply_penalties(self, row: torch.Tensor, request: Request) -> None:  # row: [V]
        params = request.sampling_params
        vocab = row.shape[0]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(request.prompt_token_ids + request.output_token_ids,
                                device=row.device).clamp_(0, vocab - 1).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                    values * params.repetition_penalty)
        if (params.frequency_penalty or params.presence_penalty) and request.output_token_ids:
            out = torch.tensor(request.output_token_ids, device=row.device).clamp_(0, vocab - 1)
            counts = torch.bincount(out, minlength=vocab).to(row.dtype)  # [V]
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += list(request.eos_token_ids)
            banned = [t for t in banned if 0 <= t < vocab]
            if banned:
                row[banned] = float("-inf")

    def _draw(self, row: torch.Tensor, request: Request) -> torch.Tensor:  # row: [V] -> []
        params: SamplingParams = request.sampling_params
        scaled = row / params.temperature
        if params.top_k > 0 and params.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            drop = cumulative - sorted_probs > params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        # The exponential race: argmax(p / E) with E ~ Exp(1) draws from p with one generator call.
        noise = torch.empty_like(probs).exponential_(generator=self._generator_for(request))
        return (probs / noise).argmax()


def index_on_device(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices on the device without waiting for the GPU (pinned, non-blocking copy)."""
    indices = torch.tensor(rows, dtype=torch.long)
    if device.type == "cuda":
        return indices.pin_memory().to(device, non_blocking=True)
    return indices


def _token_logprobs(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    # row: [V] log-probabilities
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, indices = torch.topk(row, num_top)
        top = list(zip(indices.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id=token_id, logprob=float(row[token_id]), top=top)


@contextlib.contextmanager
def _row_of(failed: dict[int, str], row: int) -> Iterator[None]:
    """One row's work: an exception fails that row alone (device faults propagate)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - recorded as this row's failure
        if is_device_fault(error):
            raise
        failed[row] = f"{type(error).__name__}: {error}"
