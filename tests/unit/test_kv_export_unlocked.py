"""A holder copies cached blocks off its engine thread, mid-step (kv_transfer.
export_blocks_unlocked, kv_write_generations.py), on the tiny model (CPU, no Ray): the bytes
equal the step-boundary export's and give the computed greedy tokens; a block written while
it was copied, or whose write has not landed, is left out, never sent with other bytes."""

from __future__ import annotations

import threading
from unittest import mock

import numpy as np
from test_kv_transfer import ALL, BLOCK, PROMPT_BLOCKS, TIER_GIB, engine, model_path, prompt, run

from iterserve.replica import kv_transfer
from iterserve.replica.kv_transfer import (
    can_export_unlocked,
    export_blocks,
    export_blocks_unlocked,
    import_blocks,
)

__all__ = ["model_path"]  # the module fixture, shared


def test_an_unlocked_export_is_the_step_boundary_export(model_path: str) -> None:
    holder = engine(model_path, kv_offloading_size=TIER_GIB)
    receiver = engine(model_path, kv_offloading_size=TIER_GIB)
    assert can_export_unlocked(holder)
    tokens = prompt()
    computed, _ = run(holder, tokens)
    unlocked = export_blocks_unlocked(holder, tokens, b"", 0, ALL)
    at_boundary = export_blocks(holder, tokens, b"", 0, ALL)
    assert unlocked.num_blocks == PROMPT_BLOCKS
    assert unlocked.stable_hashes == at_boundary.stable_hashes
    assert np.array_equal(unlocked.kv, at_boundary.kv)
    assert import_blocks(receiver, tokens, b"", unlocked) == PROMPT_BLOCKS
    assert run(receiver, tokens) == (computed, PROMPT_BLOCKS * BLOCK)
    for seed in range(8):  # the prompt's blocks leave the device for the host tier
        run(holder, prompt(100 + seed))
    from_host = export_blocks_unlocked(holder, tokens, b"", 0, ALL)
    assert from_host.num_blocks == PROMPT_BLOCKS and np.array_equal(from_host.kv, unlocked.kv)


def test_a_block_evicted_while_it_was_copied_is_left_out(model_path: str) -> None:
    """The engine thread's steps run *during* the copy (played here in order, on one
    thread): the prompt's blocks leave the device and the host tier for fillers' blocks,
    so the copy may hold other blocks' bytes, and the export must drop them."""
    holder = engine(model_path, kv_offloading_size=8 * 2 * 4 * BLOCK * 4 * 32 * 4 / 2**30)
    tokens = prompt()
    run(holder, tokens)
    copy = kv_transfer._copy_hits

    def copy_then_evict(*args: object) -> np.ndarray:
        copied = copy(*args)
        for seed in range(8):  # 48 filler blocks through 32 device blocks and 8 host slots
            run(holder, prompt(300 + seed))
        return copied

    with mock.patch.object(kv_transfer, "_copy_hits", copy_then_evict):
        payload = export_blocks_unlocked(holder, tokens, b"", 0, ALL)
    assert payload.num_blocks == 0 and payload.kv.shape[0] == 0
    assert export_blocks(holder, tokens, b"", 0, ALL).num_blocks == 0  # gone indeed


def test_a_block_whose_copy_has_not_landed_is_not_exported_until_its_step(
        model_path: str) -> None:
    holder, receiver = engine(model_path), engine(model_path, kv_offloading_size=TIER_GIB)
    tokens = prompt()
    computed, _ = run(holder, tokens)
    assert import_blocks(receiver, tokens, b"", export_blocks(holder, tokens, b"", 0, ALL)) \
        == PROMPT_BLOCKS
    # Slots taken, bytes written by the next step: an unlocked copy would read old bytes.
    assert export_blocks_unlocked(receiver, tokens, b"", 0, ALL).num_blocks == 0
    assert run(receiver, tokens) == (computed, PROMPT_BLOCKS * BLOCK)
    assert export_blocks_unlocked(receiver, tokens, b"", 0, ALL).num_blocks == PROMPT_BLOCKS


def test_exports_racing_a_busy_engine_send_only_the_blocks_own_bytes(model_path: str) -> None:
    """Real threads: one exports the prompt over and over while the engine thread serves
    fillers that push it out of the device and the host tier. Every block an export keeps
    has exactly the bytes the prompt's computation left (the prompt is never recomputed)."""
    holder = engine(model_path, kv_offloading_size=16 * 2 * 4 * BLOCK * 4 * 32 * 4 / 2**30)
    tokens = prompt()
    run(holder, tokens)
    reference = export_blocks(holder, tokens, b"", 0, ALL).kv
    done = threading.Event()
    kept: list[int] = []

    def export_until_done() -> None:
        while not done.is_set():
            payload = export_blocks_unlocked(holder, tokens, b"", 0, ALL)
            assert np.array_equal(payload.kv, reference[: payload.num_blocks])
            kept.append(payload.num_blocks)

    exporter = threading.Thread(target=export_until_done)
    exporter.start()
    try:
        for seed in range(12):
            run(holder, prompt(500 + seed))
    finally:
        done.set()
        exporter.join()
    assert kept[0] == PROMPT_BLOCKS and kept[-1] == 0  # from all of it to none of it
