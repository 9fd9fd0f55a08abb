"""The eager step's inputs: one packed int32 buffer, one copy, views of the right shapes."""

from __future__ import annotations

import numpy as np
import torch

from iterserve.replica.step_inputs import PackedStepInputs


def _arrays(num_tokens: int, num_seqs: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 50_000, num_tokens),  # int64, as prepare_inputs makes them
        "slot_mapping": rng.integers(-1, 1 << 20, num_tokens),
        "seq_lens": rng.integers(1, 4096, num_seqs).astype(np.int32),
        "block_tables": rng.integers(0, 1 << 16, (num_seqs, 7)).astype(np.int32),
        "pending_where": np.asarray([]),  # an empty list arrives as a float array: still fine
        "split_work": rng.integers(0, 64, (5, 2)).astype(np.int32),
    }


def test_every_array_comes_back_int32_with_its_shape_and_values() -> None:
    packed = PackedStepInputs(torch.device("cpu"))
    for step, (tokens, seqs) in enumerate([(9, 3), (300, 40), (1, 1), (300, 40)]):
        arrays = _arrays(tokens, seqs, step)
        views = packed.upload(arrays)
        assert list(views) == list(arrays)
        for name, array in arrays.items():
            assert views[name].dtype == torch.int32 and tuple(views[name].shape) == array.shape, name
            assert np.array_equal(views[name].numpy(), array.astype(np.int32)), (step, name)
        # All views share one device buffer: the step ships them with one copy.
        assert {v.untyped_storage().data_ptr() for v in views.values()} == {
            packed.device_buffer.untyped_storage().data_ptr()}


def test_buffers_grow_to_a_power_of_two_and_are_reused() -> None:
    packed = PackedStepInputs(torch.device("cpu"))
    packed.upload(_arrays(300, 40, 0))
    big = packed.device_buffer
    total = 300 * 2 + 40 + 40 * 7 + 10
    assert big.numel() == 1 << (total - 1).bit_length()
    packed.upload(_arrays(9, 3, 1))  # smaller: the same buffers
    assert packed.device_buffer is big
    assert packed.turn == 0  # two host twins alternate



def test_each_eager_step_ships_its_inputs_in_one_upload(monkeypatch) -> None:  # noqa: ANN001
    from iterserve.replica import LLM, SamplingParams
    from iterserve.replica.make_model import default_model_path
    from iterserve.replica.model_runner import ModelRunner

    uploads: list[list[str]] = []
    forwards: list[int] = []
    upload, forward = PackedStepInputs.upload, ModelRunner._forward

    def counting_upload(self: PackedStepInputs, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        uploads.append(list(arrays))
        return upload(self, arrays)

    def counting_forward(self: ModelRunner, prepared: object) -> object:
        forwards.append(1)
        return forward(self, prepared)

    monkeypatch.setattr(PackedStepInputs, "upload", counting_upload)
    monkeypatch.setattr(ModelRunner, "_forward", counting_forward)
    llm = LLM(str(default_model_path()), dtype="float32", max_num_batched_tokens=16, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([list(range(20, 45)), [5, 6, 7]], params)
    # CPU: every step is eager (no CUDA graphs), and each makes exactly one upload.
    assert forwards and len(uploads) == len(forwards)
    assert all({"input_ids", "positions", "slot_mapping", "block_tables", "logits_indices"} <= set(u)
               for u in uploads)
