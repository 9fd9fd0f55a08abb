"""PEFT adapters made here on the tiny random model: the test-only oracle of the LoRA tests.

`peft` (a test-only dependency) builds each adapter on the HF model of a `make_model`
checkpoint, with random non-zero A and B (B defaults to zero in PEFT, which would make every
adapter the base model), and saves it in PEFT's own format: adapter_config.json and
adapter_model.safetensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# Three adapters that differ in what they adapt: every projection, attention's q/v alone,
# and the MLP plus o_proj (rsLoRA scaling on one of them).
ADAPTER_TARGETS = {
    "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "qv": (["q_proj", "v_proj"], False),
    "mlp_o": (["gate_proj", "up_proj", "down_proj", "o_proj"], True),
}


def make_adapter(base: Path, out: Path, targets: list[str], seed: int, rank: int = 8,
                 rslora: bool = False, scale: float = 0.08) -> Path:
    """A saved PEFT adapter of `base` with seeded random A and B."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             lora_dropout=0.0, use_rslora=rslora)
    peft_model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]],
                num_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """PEFT's model (unmerged LoRA) greedy tokens per prompt, and at each step the gap
    between its top two logits (how near a tie the choice was)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    tokens, gaps = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            chosen, margin = [], []
            for _ in range(num_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                top = torch.topk(logits, 2)
                chosen.append(int(top.indices[0]))
                margin.append(float(top.values[0] - top.values[1]))
                ids.append(chosen[-1])
            tokens.append(chosen)
            gaps.append(margin)
    return tokens, gaps
