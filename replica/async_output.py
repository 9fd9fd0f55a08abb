"""The host side of a launched step: sampled ids copied to pinned memory behind an event.

`ModelRunner.launch` enqueues the forward pass and sampling on the CUDA stream, then
enqueues non-blocking copies of the sampled ids (and any logprobs) into pinned host memory
and records an event after them. Nothing waits: Python returns to plan the next step while
the GPU computes. `result()` waits on that event alone (not on later steps queued behind it)
and builds the RunnerOutput. On a CPU device every tensor is already computed and result()
only converts. As vLLM's AsyncGPUModelRunnerOutput does.
"""

from __future__ import annotations

import torch

from iterserve.replica.outputs import RunnerOutput, TokenLogprobs
from iterserve.replica.request import Request
from iterserve.replica.sampler import index_on_device


class PendingOutput:
    def __init__(
        self,
        requests: list[Request],
        token_ids: torch.Tensor,  # [S] int64 on the device
        log_probs: torch.Tensor | None,  # [W, V] for the W rows in logprob_rows
        logprob_rows: list[int],
        failed: dict[int, str],  # row -> what went wrong: no token for that request
    ) -> None:
        self.request_ids = [r.request_id for r in requests]
        self.failed = failed
        self.logprob_rows = logprob_rows
        self.num_tops = [requests[row].sampling_params.logprobs or 0 for row in logprob_rows]
        tensors = [token_ids]
        if log_probs is not None:
            # The chosen token's logprob and the top alternatives, computed on the device now
            # so that result() needs no kernel queued behind the next step.
            chosen = log_probs.gather(1, token_ids[index_on_device(logprob_rows, token_ids.device)][:, None])
            k = max(self.num_tops)
            top = torch.topk(log_probs, k, dim=-1) if k > 0 else None
            tensors += [chosen[:, 0]]
            if top is not None:
                tensors += [top.values, top.indices]
        self._event: torch.cuda.Event | None = None
        if token_ids.device.type == "cuda":
            self._host = [_pinned_copy(t) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def result(self) -> RunnerOutput:
        if self._event is not None:
            self._event.synchronize()  # this step's copies only
        token_ids = self._host[0].tolist()
        output = RunnerOutput(sampled_token_ids=dict(zip(self.request_ids, token_ids, strict=True)))
        for row, error in self.failed.items():
            output.sampled_token_ids.pop(self.request_ids[row])
            output.failed[self.request_ids[row]] = error
        if len(self._host) > 1:
            chosen = self._host[1].tolist()
            values = self._host[2].tolist() if len(self._host) > 2 else None
            indices = self._host[3].tolist() if len(self._host) > 2 else None
            for k, row in enumerate(self.logprob_rows):
                if row in self.failed:
                    continue
                n = self.num_tops[k]
                top = list(zip(indices[k][:n], values[k][:n], strict=True)) if n else []
                output.logprobs[self.request_ids[row]] = TokenLogprobs(
                    token_id=token_ids[row], logprob=chosen[k], top=top)
        return output


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
