"""How a holder cuts a pull into chunks (deploy/kv_pull.export_chunks), on the tiny model.

No Ray runs in unit tests: `ray.put` is replaced by a function that hands the payload back
itself, and the engine's `call` runs here, as between two of its steps (counted: each is a
wait the holder's batch would see)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
from test_kv_transfer import ALL, PROMPT_BLOCKS, TIER_GIB, engine, model_path, prompt, run

from iterserve.deploy import kv_pull
from iterserve.deploy.kv_pull import export_chunks
from iterserve.replica.kv_transfer import KVBlockPayload, export_blocks
from iterserve.replica.llm_engine import LLMEngine

__all__ = ["model_path"]  # the module fixture, shared


class Holder:
    """The two members of an AsyncLLMEngine that export_chunks uses."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.step_boundaries = 0

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:  # noqa: ANN401
        self.step_boundaries += 1
        return fn(self.engine)


def export(holder: Holder, tokens: list[int], chunk_blocks: int) -> list[KVBlockPayload]:
    """The prompt's blocks, asked for as a puller asks: the bytes of the blocks it lacks."""
    per_block = holder.engine.runner.kv_bytes_per_block
    with mock.patch.object(kv_pull.ray, "put", lambda payload: payload), \
            mock.patch.object(kv_pull, "CHUNK_BYTES", chunk_blocks * per_block):
        return asyncio.run(export_chunks(holder, tokens, b"", 0, PROMPT_BLOCKS * per_block))


def served_holder(model_path: str) -> tuple[Holder, list[int], np.ndarray]:
    """A holder that computed the prompt, and the prompt's blocks as one export gives them."""
    holder = Holder(engine(model_path, kv_offloading_size=TIER_GIB))
    tokens = prompt()
    run(holder.engine, tokens)
    return holder, tokens, export_blocks(holder.engine, tokens, b"", 0, ALL).kv


def test_a_pull_copied_off_the_engine_thread_is_one_chunk_however_long(
        model_path: str) -> None:
    holder, tokens, reference = served_holder(model_path)
    chunks = export(holder, tokens, chunk_blocks=2)
    assert [chunk.num_blocks for chunk in chunks] == [PROMPT_BLOCKS]
    assert holder.step_boundaries == 0  # its batch never waited
    assert np.array_equal(chunks[0].kv, reference)


def test_a_pull_copied_between_steps_comes_a_chunk_at_a_time(model_path: str) -> None:
    holder, tokens, reference = served_holder(model_path)
    with mock.patch.object(kv_pull, "can_export_unlocked", lambda _engine: False):
        chunks = export(holder, tokens, chunk_blocks=2)
    assert [chunk.num_blocks for chunk in chunks] == [2, 2, 1]
    assert holder.step_boundaries == 3
    assert np.array_equal(np.concatenate([chunk.kv for chunk in chunks]), reference)


def test_a_copy_cut_short_is_finished_between_steps_at_most_a_chunk_beyond_it(
        model_path: str) -> None:
    """The copy off the engine thread keeps one block each time (as when the next one is
    being written): each time the step boundary adds at most one chunk, then the copy off
    the thread takes over again, until every block asked for is sent."""
    holder, tokens, reference = served_holder(model_path)
    per_block = holder.engine.runner.kv_bytes_per_block
    unlocked = kv_pull.export_blocks_unlocked

    def one_block_at_a_time(engine: LLMEngine, token_ids: list[int], namespace: bytes,
                            first_block: int, max_bytes: int) -> KVBlockPayload:
        return unlocked(engine, token_ids, namespace, first_block, min(max_bytes, per_block))

    with mock.patch.object(kv_pull, "export_blocks_unlocked", one_block_at_a_time):
        chunks = export(holder, tokens, chunk_blocks=2)
    assert [chunk.num_blocks for chunk in chunks] == [3, 2]  # 1 + 2, then 1 + the last 1
    assert holder.step_boundaries == 2
    assert np.array_equal(np.concatenate([chunk.kv for chunk in chunks]), reference)
