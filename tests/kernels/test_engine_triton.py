"""The engine end to end on the Triton kernels (interpreted on CPU) against the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve.replica import LLM, SamplingParams
from iterserve.replica.make_model import default_model_path, write_model

PROMPTS = [[5, 6, 7], list(range(20, 57)), [1000 + i for i in range(19)]]


def _greedy(backend: str) -> list[list[int]]:
    # A small token budget chunks the 37-token prompt, so steps mix decodes and chunks: the
    # decode launch and the chunk launch run in the same step.
    llm = LLM(str(default_model_path()), attention_backend=backend, dtype="float32",
              max_num_batched_tokens=24, block_size=16)
    assert llm.engine.runner.ops.name == backend
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


@pytest.mark.slow
@pytest.mark.parametrize("forced_splits", [None, 4], ids=["engine-choice", "split-kv-4"])
def test_triton_backend_gives_the_same_greedy_tokens_as_torch(
    monkeypatch: pytest.MonkeyPatch, forced_splits: int | None
) -> None:
    want = _greedy("torch")
    if forced_splits is not None:  # the CPU runner never splits by itself (no SMs to fill)
        from iterserve.replica.model_runner import ModelRunner

        monkeypatch.setattr(ModelRunner, "_decode_kv_splits", lambda *args: forced_splits)
    built = _count_work_lists(monkeypatch)
    assert _greedy("triton") == want
    # The eager steps ran over host-built work lists: chunks always, split-KV when it split.
    assert built["prefill_work"] > 0
    assert (built["split_work"] > 0) == (forced_splits is not None)


def _count_work_lists(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    from iterserve.kernels import work_lists

    built = {"prefill_work": 0, "split_work": 0}
    for name in built:
        original = getattr(work_lists, name)

        def counting(*args: object, _name: str = name, _original: object = original) -> object:
            built[_name] += 1
            return _original(*args)

        monkeypatch.setattr(work_lists, name, counting)
    return built


def test_unsupported_head_dim_is_refused_at_engine_start(tmp_path: Path) -> None:
    # head_dim 72 (a 576-wide model with 8 heads): no padded power-of-two tile serves it.
    folder = write_model(tmp_path / "hd72", arch="llama", overrides={
        "hidden_size": 576, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 72})
    with pytest.raises(ValueError, match="head_dim 72 is not supported by the Triton"):
        LLM(str(folder), attention_backend="triton", dtype="float32")
    LLM(str(folder), attention_backend="torch", dtype="float32")  # the torch path serves it
