"""Prefix pulls between two real LLMReplicas on a local Ray Serve (deploy/kv_pull.py): the
tiny model on CPU, a host KV tier on each, the KV-aware router hinting the holder.

A prompt served on replica A is then sent to replica B (placed there with route_to_replica):
B pulls A's blocks through the object store and answers with the same greedy tokens, its
prompt reported cached. Then a second prompt served on A is sent to B and A's actor is killed
as B starts to pull it: the pull finds the holder gone at once (holder_gone, well under the
5 s pull timeout), and the request completes by computing, with A's tokens. kv_pull=always:
the tiny model prefills faster than any pull, so the cost rule would (rightly) never pull here.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX  # noqa: E402
from ray.serve._private.constants import SERVE_NAMESPACE  # noqa: E402

from iterserve.deploy.app import APP_NAME  # noqa: E402
from iterserve.replica.sampling_params import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
_ids = itertools.count()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(20 * BLOCK + 3)]


def _send(handle: serve.handle.DeploymentHandle, prompt: list[int], replica: str,
          **kwargs: object) -> serve.handle.DeploymentResponseGenerator:
    """One greedy request placed on `replica`, sent (not read)."""
    return handle.options(stream=True).generate.remote(
        prompt, GREEDY, f"pull-{next(_ids)}", route_to_replica=replica, **kwargs)


def _read(stream: serve.handle.DeploymentResponseGenerator) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of a sent request."""
    tokens: list[int] = []
    cached = -1
    for output in stream:
        tokens += output.new_token_ids
        cached = output.num_cached_tokens
    return tokens, cached


def _replica_ids(handle: serve.handle.DeploymentHandle) -> list[str]:
    seen: set[str] = set()
    deadline = time.time() + 60
    while len(seen) < 2 and time.time() < deadline:
        seen.update(handle.info.remote().result()["replica_id"] for _ in range(6))
    assert len(seen) == 2, f"expected two replicas, saw {seen}"
    return sorted(seen)


def _pulls(handle: serve.handle.DeploymentHandle, replica: str) -> dict[str, int]:
    return handle.info.remote(route_to_replica=replica).result()["kv_pulls"]


def test_a_replica_pulls_a_peers_prefix_and_computes_when_the_peer_dies(
        integration: Any) -> None:  # noqa: ANN401
    args = {**integration.SMALL_ENGINE, "num_replicas": 2, "router": "kv", "kv_offloading_size": 0.01,
            "kv_pull": "always", "kv_pull_timeout_s": 5.0}
    with integration.serve_app(args):
        handle = serve.get_deployment_handle("LLMReplica", APP_NAME)
        holder, receiver = _replica_ids(handle)
        prompt = _prompt(1)
        computed, cached = _read(_send(handle, prompt, holder))
        assert cached == 0
        time.sleep(1.5)  # routing-stats periods: the holder's report reaches the router
        pulled, cached = _read(_send(handle, prompt, receiver))
        assert pulled == computed
        assert cached == 20 * BLOCK  # every full block but the last token's came from A
        assert _pulls(handle, receiver) == {"pulled": 1}
        exported = handle.info.remote(route_to_replica=holder).result()["kv_exported"]
        assert exported["calls"] == 1 and exported["seconds"]["copy"] > 0  # its side, timed

        second = _prompt(2)
        expected, _ = _read(_send(handle, second, holder))
        actor = ray.get_actor(f"{REPLICA_ID_FULL_ID_STR_PREFIX}{APP_NAME}#LLMReplica#{holder}",
                              namespace=SERVE_NAMESPACE)
        # The hint named here, as the router would: it may already have dropped the holder.
        started = time.monotonic()
        stream = _send(handle, second, receiver, kv_pull_hint=(holder, 20 * BLOCK))
        ray.kill(actor, no_restart=True)  # as the receiver starts its pull
        tokens, cached = _read(stream)
        assert time.monotonic() - started < 2.5  # the pull's timeout is 5 s
        assert tokens == expected and cached == 0
        assert _pulls(handle, receiver) == {"pulled": 1, "holder_gone": 1}
