"""The disk KV tier in the engine, on the tiny model (CPU, offline engine): blocks pushed
through a small host tier onto disk come back on returning chat turns with the same greedy
tokens; a corrupt file, a full disk, another layout and a restart behave as promised."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import pytest

from iterserve.replica import EngineConfig, LLMEngine, SamplingParams
from iterserve.replica.make_model import default_model_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
DEVICE_BLOCKS = 12  # one conversation's turn fills 6: six evict each other
BYTES_PER_BLOCK = 2 * 4 * BLOCK * 4 * 32 * 4  # the tiny model's K and V, fp32
HOST_GIB = 8 * BYTES_PER_BLOCK / 2**30  # 8 blocks: less than two conversations' prefixes
NUM_CONVERSATIONS = 6
PROMPT_BLOCKS = 5  # a returning turn's history: 80 + 8 + 2 tokens, 5 full blocks


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(default_model_path())


def first_turns() -> list[list[int]]:
    rng = random.Random(40)
    return [[rng.randrange(10, 4000) for _ in range(80)] for _ in range(NUM_CONVERSATIONS)]


def engine_at(model_path: str, disk: Path | None, **kwargs: object) -> LLMEngine:
    tiers = {} if disk is None else dict(kv_offloading_size=HOST_GIB,
                                         kv_offloading_disk_path=str(disk))
    return LLMEngine(EngineConfig.from_kwargs(
        model=model_path, num_gpu_blocks_override=DEVICE_BLOCKS,
        block_size=kwargs.pop("block_size", BLOCK), **tiers, **kwargs))


def run_alone(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """One request to its end, the engine's invariants checked every step: (tokens, cached).
    The disk tier's writes are waited for after it, so that runs are deterministic."""
    engine.add_request(prompt, GREEDY)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
            cached = output.num_cached_tokens
        engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0
    disk = getattr(engine.runner, "disk_tier", None)
    if disk is not None:
        disk.flush()
    return tokens, cached


def turns(engine: LLMEngine, histories: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """One turn of every conversation, one at a time: (answers, cached tokens); each
    history grows by its answer and the user's next words."""
    answers, cached = [], []
    for i, history in enumerate(histories):
        answer, hit = run_alone(engine, history)
        answers.append(answer)
        cached.append(hit)
        histories[i] = history + answer + [100 + len(history) % 7, 200 + i]
    return answers, cached


def push_to_disk(engine: LLMEngine) -> None:
    """Prompts that are never asked again, enough to push every earlier block out of the
    device (12 blocks) and the host tier (8) onto disk."""
    rng = random.Random(7)
    for _ in range(4):
        run_alone(engine, [rng.randrange(10, 4000) for _ in range(100)])


@pytest.fixture(scope="module")
def tiers_off(model_path: str) -> list[list[int]]:
    """The greedy answers of three turns with no tier below the device."""
    engine = engine_at(model_path, None)
    histories = first_turns()
    return [answer for _ in range(3) for answer in turns(engine, histories)[0]]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_returning_turns_come_back_from_disk_with_the_same_tokens(
        model_path: str, tiers_off: list[list[int]], tmp_path: Path,
        async_scheduling: bool) -> None:
    engine = engine_at(model_path, tmp_path, async_scheduling=async_scheduling)
    histories = first_turns()
    answers, cached = [], []
    for _ in range(3):
        turn_answers, turn_cached = turns(engine, histories)
        answers += turn_answers
        cached += turn_cached
    assert answers == tiers_off
    # Six conversations' prefixes do not fit the device (12 blocks) nor the host tier (8):
    # every returning turn's history comes back whole, from disk.
    assert cached[:NUM_CONVERSATIONS] == [0] * NUM_CONVERSATIONS
    assert cached[NUM_CONVERSATIONS:2 * NUM_CONVERSATIONS] == [PROMPT_BLOCKS * BLOCK] * 6
    assert all(hit >= PROMPT_BLOCKS * BLOCK for hit in cached[2 * NUM_CONVERSATIONS:])
    manager, disk = engine.block_manager, engine.runner.disk_tier
    assert manager.disk_hits > 0 and manager.prefix_hits + manager.host_hits + \
        manager.disk_hits == sum(cached)
    stats = engine.stats()  # what the metrics read
    assert (stats.disk_cache_queries, stats.disk_cache_hits) == (manager.disk_queries,
                                                                  manager.disk_hits)
    assert stats.kv_offload_bytes["DISK_to_CPU"] == manager.disk_hits // BLOCK * BYTES_PER_BLOCK
    assert stats.kv_offload_bytes["CPU_to_DISK"] > 0
    assert stats.kv_offload_seconds["DISK_to_CPU"] > 0
    assert set(stats.disk_errors.values()) == {0}
    assert len(disk) > 0 and disk.used_bytes <= disk.capacity_bytes


def test_a_corrupt_file_is_detected_and_its_block_recomputed(
        model_path: str, tiers_off: list[list[int]], tmp_path: Path) -> None:
    engine = engine_at(model_path, tmp_path)
    histories = first_turns()
    turns(engine, histories)
    push_to_disk(engine)
    disk = engine.runner.disk_tier
    files = sorted(disk.store.directory.glob("*.kv"))
    assert files
    for path in files:  # one flipped bit in every block file
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    answers, cached = turns(engine, histories)
    assert answers == tiers_off[NUM_CONVERSATIONS:2 * NUM_CONVERSATIONS]
    # Each returning turn read its first block's file, found it corrupt, deleted it and
    # computed its whole prompt (a chain stops at its first miss).
    assert cached == [0] * NUM_CONVERSATIONS
    errors = disk.counters()[2]
    assert errors["corrupt"] == NUM_CONVERSATIONS and engine.block_manager.disk_hits == 0
    assert engine.stats().disk_errors["corrupt"] == NUM_CONVERSATIONS


def test_a_restarted_engine_on_the_same_folder_hits(
        model_path: str, tiers_off: list[list[int]], tmp_path: Path) -> None:
    first = engine_at(model_path, tmp_path)
    histories = first_turns()
    turns(first, histories)
    push_to_disk(first)
    first.runner.disk_tier.close()
    del first

    restarted = engine_at(model_path, tmp_path)
    assert len(restarted.runner.disk_tier) > 0
    answers, cached = turns(restarted, histories)
    assert answers == tiers_off[NUM_CONVERSATIONS:2 * NUM_CONVERSATIONS]
    assert restarted.block_manager.disk_hits > 0 and max(cached) == PROMPT_BLOCKS * BLOCK


def test_blocks_of_another_block_size_are_never_read(model_path: str, tmp_path: Path) -> None:
    writer = engine_at(model_path, tmp_path)
    turns(writer, first_turns())
    writer.runner.disk_tier.close()
    assert len(writer.runner.disk_tier) > 0
    other = engine_at(model_path, tmp_path, block_size=8)
    assert len(other.runner.disk_tier) == 0  # another folder: another layout identity
    assert other.runner.disk_tier.store.directory != writer.runner.disk_tier.store.directory
    _, cached = turns(other, first_turns())  # the very prompts whose blocks the writer left
    assert cached == [0] * NUM_CONVERSATIONS
    assert other.block_manager.disk_hits == 0 and set(other.stats().disk_errors.values()) == {0}


def test_a_full_disk_is_counted_and_the_blocks_are_computed(
        model_path: str, tiers_off: list[list[int]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC: the store's write raises it as the kernel would (this shared machine's disk
    cannot be filled for a test)."""
    engine = engine_at(model_path, tmp_path)
    disk = engine.runner.disk_tier

    def no_space(stable_hash: int, payload: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.store, "write", no_space)
    histories = first_turns()
    answers, _ = turns(engine, histories)
    answers2, cached = turns(engine, histories)
    assert answers + answers2 == tiers_off[: 2 * NUM_CONVERSATIONS]
    assert disk.counters()[2]["disk_full"] > 0 and len(disk) == 0
    assert engine.block_manager.disk_hits == 0
    assert cached[0] < PROMPT_BLOCKS * BLOCK  # the evicted prefixes were computed again


def test_a_replica_shutting_down_lands_its_queued_writes(
        model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncLLMEngine.shutdown (a Serve replica's end) waits for the disk tier's writer, so
    the blocks it was given are on disk for the replica that starts next on the folder."""
    import time

    from iterserve.replica.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig.from_kwargs(
        model=model_path, num_gpu_blocks_override=DEVICE_BLOCKS, block_size=BLOCK,
        kv_offloading_size=HOST_GIB, kv_offloading_disk_path=str(tmp_path)))
    disk = engine.engine.runner.disk_tier
    real_write = disk.store.write

    def slow_write(stable_hash: int, data: bytes) -> int:  # a slow disk: 20 ms a block
        time.sleep(0.02)
        return real_write(stable_hash, data)

    monkeypatch.setattr(disk.store, "write", slow_write)
    payload = bytes(BYTES_PER_BLOCK)
    for stable in range(1, 9):  # queued now, written by the writer thread
        disk.write_async(stable, payload)
    engine.shutdown()
    assert len(list(disk.store.directory.glob("*.kv"))) == 8  # not later: now
    restarted = engine_at(model_path, tmp_path)
    assert len(restarted.runner.disk_tier) == 8
    assert restarted.runner.disk_tier.read(5) == payload


def test_cached_tokens_over_http_count_the_blocks_read_from_disk(model_path: str,
                                                                 tmp_path: Path) -> None:
    """usage.prompt_tokens_details.cached_tokens through the ingress's FastAPI app (in
    process, no Ray) counts a prefix that came back from the disk tier."""
    from fastapi.testclient import TestClient

    from iterserve.deploy.engine_client import LocalEngineClient
    from iterserve.deploy.server import IngressSettings, create_app
    from iterserve.replica.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(EngineConfig.from_kwargs(
        model=model_path, num_gpu_blocks_override=DEVICE_BLOCKS, block_size=BLOCK,
        kv_offloading_size=HOST_GIB, kv_offloading_disk_path=str(tmp_path)))
    rng = random.Random(3)
    document = [rng.randrange(10, 4000) for _ in range(80)]  # 5 full blocks
    fillers = [[rng.randrange(10, 4000) for _ in range(100)] for _ in range(4)]

    def cached_tokens(http: TestClient, prompt: list[int]) -> int:
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0.0})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        with TestClient(create_app(LocalEngineClient(engine), IngressSettings())) as http:
            assert cached_tokens(http, document + [1]) == 0
            for filler in fillers:  # the document's blocks go through the host to disk
                cached_tokens(http, filler)
            engine.engine.runner.disk_tier.flush()
            assert cached_tokens(http, document + [2, 3]) == 5 * BLOCK
        assert engine.engine.block_manager.disk_hits == 5 * BLOCK
    finally:
        engine.shutdown()


def test_the_replicas_report_names_the_prefixes_on_disk(model_path: str,
                                                        tmp_path: Path) -> None:
    """Blocks pushed through the host tier onto disk are reported under "disk", and a router
    reading the report finds a returning turn's history there (a restarted engine's files
    included): the router charges them a disk read, not a prefill."""
    from iterserve.autoscale.replica_cache_reports import cached_prefix_tiers
    from iterserve.autoscale.signals import ReplicaLoad

    engine = engine_at(model_path, tmp_path)
    histories = first_turns()
    turns(engine, histories)
    push_to_disk(engine)
    report = engine.cached_block_hashes()
    assert report is not None and report.get("disk")
    engine.runner.disk_tier.close()
    restarted = engine_at(model_path, tmp_path)
    report = restarted.cached_block_hashes()
    assert report is not None and report.get("disk") and not report.get("host")
    load = ReplicaLoad(kv_usage=0.0, num_waiting=0, num_running=0, num_free_blocks=1,
                       num_total_blocks=1, step_token_rate=0.0, timestamp=0.0,
                       ).with_cached_blocks(report, BLOCK)
    tiers = cached_prefix_tiers(histories[0], ["r"], [load])
    assert tiers is not None and tiers["r"][2] == PROMPT_BLOCKS * BLOCK  # [device, host, disk]
