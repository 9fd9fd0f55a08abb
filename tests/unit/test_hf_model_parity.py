"""Our model against HF transformers on checkpoints written by make_model, in fp32.

Prefill: several prompts of different lengths as one flat batch through the paged cache,
logits compared row by row with HF's. Greedy: 8 prompts decoded together step by step through
the paged cache must produce HF generate's token ids exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iterserve.replica.attention_metadata import AttentionMetadata
from iterserve.replica.loader import load_checkpoint
from iterserve.replica.make_model import write_model
from iterserve.replica.models.config import ModelConfig
from iterserve.replica.ops import select_ops

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16
PROMPT_LENS = (1, 3, 8, 13, 16, 17, 40, 70)
NEW_TOKENS = 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: on a busy 2-core machine intra-op threads only contend (a test
    takes ~1.5 s with one thread and 5-30 s with two)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_prompts(vocab_size: int, lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 5 up: 0-4 are the special tokens.
    return [torch.randint(5, vocab_size, (n,), generator=generator).tolist() for n in lens]


def batch_metadata(query_lens: list[int], seq_lens: list[int], blocks_per_seq: int
                   ) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata when sequence i owns blocks [i * M, (i + 1) * M)."""
    positions, slots = [], []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pos = torch.arange(s - q, s)
        positions.append(pos)
        slots.append(i * blocks_per_seq * BLOCK_SIZE + pos)
    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    tables = torch.arange(len(seq_lens) * blocks_per_seq, dtype=torch.int32)
    attn = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables.view(len(seq_lens), blocks_per_seq),
        slot_mapping=torch.cat(slots),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        is_decode_only=all(q == 1 for q in query_lens),
    )
    return torch.cat(positions), attn


def new_kv_caches(cfg: ModelConfig, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]


def load_both(path: Path) -> tuple[torch.nn.Module, ModelConfig, torch.nn.Module]:
    ours, cfg = load_checkpoint(path, torch.float32, "cpu", select_ops("torch"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, cfg, hf


@pytest.fixture(scope="module", params=[("llama", "tiny"), ("qwen2", "tiny"),
                                        ("mistral", "micro")], ids=lambda p: "-".join(p))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, preset = request.param
    path = write_model(tmp_path_factory.mktemp(arch), seed=0, arch=arch, preset=preset)
    return arch, load_both(path)


@torch.inference_mode()
def test_prefill_batch_logits_match_hf(checkpoint):
    _, (ours, cfg, hf) = checkpoint
    prompts = make_prompts(cfg.vocab_size, PROMPT_LENS)
    lens = [len(p) for p in prompts]
    blocks_per_seq = -(-max(lens) // BLOCK_SIZE)
    positions, attn = batch_metadata(lens, lens, blocks_per_seq)
    kv = new_kv_caches(cfg, len(prompts) * blocks_per_seq)
    hidden = ours(torch.tensor(sum(prompts, [])), positions, kv, attn)  # [T, H]
    logits = ours.compute_logits(hidden)  # [T, V]
    starts = attn.query_start_loc.tolist()
    for i, prompt in enumerate(prompts):
        expected = hf(torch.tensor([prompt])).logits[0].float()  # [len, V]
        torch.testing.assert_close(logits[starts[i]:starts[i + 1]], expected,
                                   rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_tied_embeddings_logits_match_hf(tmp_path):
    path = write_model(tmp_path, arch="qwen2", preset="micro",
                       overrides={"tie_word_embeddings": True})
    ours, cfg, hf = load_both(path)
    prompt = make_prompts(cfg.vocab_size, (12,))[0]
    positions, attn = batch_metadata([12], [12], 1)
    hidden = ours(torch.tensor(prompt), positions, new_kv_caches(cfg, 1), attn)
    expected = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours.compute_logits(hidden), expected, rtol=1e-4, atol=1e-4)


def greedy_paged(model: torch.nn.Module, cfg: ModelConfig, prompts: list[list[int]],
                 new_tokens: int) -> list[list[int]]:
    """One prefill batch of every prompt, then decode steps of the whole batch."""
    blocks_per_seq = -(-(max(len(p) for p in prompts) + new_tokens) // BLOCK_SIZE)
    kv = new_kv_caches(cfg, len(prompts) * blocks_per_seq)
    seq_lens = [len(p) for p in prompts]
    query_lens = list(seq_lens)
    inputs = sum(prompts, [])
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(new_tokens):
        positions, attn = batch_metadata(query_lens, seq_lens, blocks_per_seq)
        hidden = model(torch.tensor(inputs), positions, kv, attn)  # [T, H]
        last_rows = attn.query_start_loc[1:].long() - 1
        next_ids = model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()  # [S]
        for out, token in zip(outputs, next_ids, strict=True):
            out.append(token)
        inputs, query_lens = next_ids, [1] * len(prompts)
        seq_lens = [n + 1 for n in seq_lens]
    return outputs


@pytest.mark.parametrize(("arch", "preset"), [("llama", "tiny"), ("qwen2", "tiny")])
@torch.inference_mode()
def test_greedy_decode_matches_hf_generate(tmp_path, arch, preset):
    path = write_model(tmp_path, seed=0, arch=arch, preset=preset)
    ours, cfg, hf = load_both(path)
    prompts = make_prompts(cfg.vocab_size, PROMPT_LENS, seed=1)
    ours_ids = greedy_paged(ours, cfg, prompts, NEW_TOKENS)
    hf.generation_config.eos_token_id = None  # the random model may emit eos; keep going
    for prompt, got in zip(prompts, ours_ids, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()
    assert len({tuple(o) for o in ours_ids}) == len(prompts)  # the prompts really differ
    assert min(len(set(o)) for o in ours_ids) > 4  # not a degenerate repeat of one token
