"""Greedy parity with HF transformers through the whole engine (a test-only dependency).

Eight prompts of different lengths run as one continuously batched workload; every one
must produce exactly the token ids HF's greedy generate produces, for 32 tokens, in fp32,
for a Llama and a Qwen2-style checkpoint made by `make_model`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from iterserve.replica import LLM, SamplingParams
from iterserve.replica.make_model import write_model

transformers = pytest.importorskip("transformers")

NUM_TOKENS = 32
LENGTHS = [1, 5, 12, 17, 31, 48, 70, 129]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp(request.param), seed=3, arch=request.param)


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Like ignore_eos: EOS is an ordinary token. (min_new_tokens would instead forbid it.)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:  # one at a time: no padding to blur the comparison
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=NUM_TOKENS, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def test_engine_matches_hf_greedy(checkpoint: Path) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in LENGTHS]
    llm = LLM(str(checkpoint), dtype="float32", max_num_batched_tokens=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    ours = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert ours == hf_greedy(checkpoint, prompts)
