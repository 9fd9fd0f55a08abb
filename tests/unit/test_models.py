"""ModelConfig parsing, rope scaling, ops selection, and the model's paged forward.

The forward tests check the model against itself: a prompt prefilled at once, in chunks, or
token by token through the paged cache must give the same logits. HF parity is in
test_hf_model_parity.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from iterserve.replica.attention_metadata import AttentionMetadata
from iterserve.replica.loader import load_checkpoint
from iterserve.replica.make_model import write_model
from iterserve.replica.models import MODEL_REGISTRY, build_model
from iterserve.replica.models.config import ModelConfig, RopeScaling
from iterserve.replica.models.rope import cos_sin_cache, inverse_frequencies
from iterserve.replica.ops import select_ops

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 256, "eos_token_id": 2, "bos_token_id": 1,
}


class PagedCache:
    """A KV cache where sequence i owns the contiguous blocks [i * M, (i + 1) * M)."""

    def __init__(self, cfg: ModelConfig, num_seqs: int, max_len: int, block_size: int = 4,
                 dtype: torch.dtype = torch.float32) -> None:
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        shape = (num_seqs * self.blocks_per_seq, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                   for _ in range(cfg.num_hidden_layers)]
        self.lens = [0] * num_seqs

    def step(self, model: torch.nn.Module, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Run one flat batch of {seq: new token ids}; return each chunk's last-token logits."""
        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for seq, tokens in chunks.items():
            start = self.lens[seq]
            self.lens[seq] += len(tokens)
            first_block = seq * self.blocks_per_seq
            pos = list(range(start, self.lens[seq]))
            ids += tokens
            positions += pos
            slots += [first_block * self.block_size + p for p in pos]
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(self.lens[seq])
            tables.append(list(range(first_block, first_block + self.blocks_per_seq)))
        query_lens = [len(t) for t in chunks.values()]
        attn = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            is_decode_only=all(n == 1 for n in query_lens),
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), self.kv, attn)
            return model.compute_logits(hidden[torch.tensor(qsl[1:]) - 1])


@pytest.fixture(scope="module")
def micro_path(tmp_path_factory: pytest.TempPathFactory):
    return write_model(tmp_path_factory.mktemp("micro"), seed=0, arch="llama", preset="micro")


# ------------------------------------------------------------------------------ config

def test_config_parses_llama_with_derived_fields():
    cfg = ModelConfig.from_hf_config(LLAMA)
    assert cfg.head_dim == 16  # hidden / heads when head_dim is absent
    assert (cfg.q_size, cfg.kv_size) == (64, 32)
    assert cfg.eos_token_ids == (2,)
    assert not cfg.attention_bias and not cfg.o_proj_bias and not cfg.tie_word_embeddings
    assert cfg.rope_scaling == RopeScaling()


def test_config_qwen2_always_has_qkv_bias_but_no_o_bias():
    cfg = ModelConfig.from_hf_config({**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                                      "sliding_window": 128, "use_sliding_window": False})
    assert cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.sliding_window is None  # configured but switched off


def test_config_llama_attention_bias_covers_o_proj():
    cfg = ModelConfig.from_hf_config({**LLAMA, "attention_bias": True, "mlp_bias": True})
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias


def test_config_reads_transformers5_rope_parameters():
    raw = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    raw["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_config_eos_list_and_explicit_head_dim():
    cfg = ModelConfig.from_hf_config({**LLAMA, "eos_token_id": [2, 7], "head_dim": 32})
    assert cfg.eos_token_ids == (2, 7) and cfg.head_dim == 32 and cfg.q_size == 128


@pytest.mark.parametrize(("change", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"architectures": []}, "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
])
def test_config_rejects_what_it_cannot_run(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config({**LLAMA, **change})


def test_config_missing_field_is_named():
    raw = {k: v for k, v in LLAMA.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_config(raw)


def test_verify_max_model_len_rejects_sliding_window_and_long_contexts():
    mistral = ModelConfig.from_hf_config({**LLAMA, "architectures": ["MistralForCausalLM"],
                                          "sliding_window": 64})
    mistral.verify_max_model_len(64)
    with pytest.raises(ValueError, match="sliding-window"):
        mistral.verify_max_model_len(65)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelConfig.from_hf_config(LLAMA).verify_max_model_len(257)


# -------------------------------------------------------------------------------- rope

def test_rope_default_and_linear():
    base = inverse_frequencies(16, 10000.0, RopeScaling())
    assert base.shape == (8,) and base[0] == 1.0
    assert torch.allclose(base[1], torch.tensor(10000.0 ** (-2 / 16)))
    linear = inverse_frequencies(16, 10000.0, RopeScaling("linear", factor=4.0))
    assert torch.allclose(linear, base / 4)


def test_rope_llama3_keeps_high_and_slows_low_frequencies():
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    base = inverse_frequencies(128, 500000.0, RopeScaling())
    scaled = inverse_frequencies(128, 500000.0, scaling)
    wavelen = 2 * math.pi / base
    high, low = wavelen < 1024 / 4, wavelen > 1024
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(scaled[high], base[high])
    assert torch.allclose(scaled[low], base[low] / 8)
    middle = ~high & ~low
    assert ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all()


@pytest.mark.parametrize("scaling", [
    {"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
])
def test_rope_matches_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0,
                                  max_position_embeddings=4096,
                                  rope_scaling={**scaling, "rope_theta": 500000.0})
    ours = inverse_frequencies(64, 500000.0, RopeScaling.from_dict(scaling, 4096))
    if scaling["rope_type"] == "default":
        expected = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_cos_sin_cache_layout():
    table = cos_sin_cache(8, 10000.0, RopeScaling(), 16)
    assert table.shape == (16, 8) and table.dtype == torch.float32
    inv = inverse_frequencies(8, 10000.0, RopeScaling())
    torch.testing.assert_close(table[5, :4], torch.cos(5 * inv))
    torch.testing.assert_close(table[5, 4:], torch.sin(5 * inv))


# --------------------------------------------------------------------------------- ops

def test_select_ops_torch_is_the_reference():
    from iterserve.kernels import reference

    ops = select_ops("torch")
    # paged_attention drops the Triton launch hints (num_decodes, num_kv_splits), nothing else.
    assert ops.name == "torch" and ops.paged_attention.__wrapped__ is reference.paged_attention
    assert ops.silu_and_mul is reference.silu_and_mul


def test_select_ops_rejects_unknown_backend():
    with pytest.raises(ValueError, match="torch, triton"):
        select_ops("cuda")


def test_select_ops_imports_triton_kernels_only_for_triton(monkeypatch):
    import sys

    import iterserve.kernels

    # None in sys.modules makes any import of the module fail: "torch" must not try. The
    # package attribute goes too, in case another test imported the kernels already.
    monkeypatch.delattr(iterserve.kernels, "ops", raising=False)
    monkeypatch.setitem(sys.modules, "iterserve.kernels.ops", None)
    assert select_ops("torch").name == "torch"
    with pytest.raises(ImportError):
        select_ops("triton")


# ------------------------------------------------------------------------------- model

def test_registry_covers_supported_architectures():
    assert set(MODEL_REGISTRY) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


def test_build_model_has_fused_projections():
    cfg = ModelConfig.from_hf_config({**LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    model = build_model(cfg, torch.float32, "cpu", select_ops("torch"))
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == (64 + 2 * 32, 64) and attn.qkv_proj.bias is not None
    assert attn.o_proj.bias is None
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (256, 64)


def test_tied_embeddings_share_one_tensor(tmp_path):
    path = write_model(tmp_path, arch="qwen2", preset="micro",
                       overrides={"tie_word_embeddings": True})
    model, cfg = load_checkpoint(path, torch.float32, "cpu", select_ops("torch"))
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_forward_rejects_wrong_number_of_caches(micro_path):
    model, cfg = load_checkpoint(micro_path, torch.float32, "cpu", select_ops("torch"))
    cache = PagedCache(cfg, 1, 8)
    cache.kv = cache.kv[:1]
    with pytest.raises(ValueError, match="expected 2 KV caches"):
        cache.step(model, {0: [5, 6]})


def test_prefill_chunked_prefill_and_decode_agree(micro_path):
    model, cfg = load_checkpoint(micro_path, torch.float32, "cpu", select_ops("torch"))
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(11)]
    whole = PagedCache(cfg, 1, 16).step(model, {0: prompt})
    chunked = PagedCache(cfg, 1, 16)
    chunked.step(model, {0: prompt[:4]})
    chunked.step(model, {0: prompt[4:9]})
    by_chunks = chunked.step(model, {0: prompt[9:]})
    one_by_one = PagedCache(cfg, 1, 16)
    for token in prompt:
        by_tokens = one_by_one.step(model, {0: [token]})
    torch.testing.assert_close(by_chunks, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_tokens, whole, rtol=1e-5, atol=1e-5)


def test_batch_mates_do_not_change_a_sequence(micro_path):
    model, cfg = load_checkpoint(micro_path, torch.float32, "cpu", select_ops("torch"))
    prompt = [11, 12, 13, 14, 15, 16]
    alone = PagedCache(cfg, 1, 8).step(model, {0: prompt})
    mixed = PagedCache(cfg, 3, 8)
    mixed.step(model, {0: [3, 4, 5]})
    logits = mixed.step(model, {0: [6], 1: prompt, 2: [9, 9]})  # a decode and two prefills
    torch.testing.assert_close(logits[1:2], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_forward_tracks_fp32(micro_path, dtype):
    ops = select_ops("torch")
    ref_model, cfg = load_checkpoint(micro_path, torch.float32, "cpu", ops)
    model, _ = load_checkpoint(micro_path, dtype, "cpu", ops)
    assert model.model.embed_tokens.weight.dtype == dtype
    assert model.cos_sin_cache.dtype == torch.float32
    prompt = list(range(20, 40))
    expected = PagedCache(cfg, 1, 24).step(ref_model, {0: prompt})
    logits = PagedCache(cfg, 1, 24, dtype=dtype).step(model, {0: prompt})
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 0.1 * expected.abs().max()
    assert logits.argmax(-1).item() == expected.argmax(-1).item()


# -------------------------------------------------------------------------- make_model

def test_make_model_is_deterministic_per_seed(tmp_path):
    a = write_model(tmp_path / "a", seed=3, preset="micro")
    b = write_model(tmp_path / "b", seed=3, preset="micro")
    c = write_model(tmp_path / "c", seed=4, preset="micro")
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (a / name).read_bytes() == (c / name).read_bytes()


def test_make_model_cli_and_presets(tmp_path):
    from iterserve.replica.make_model import main

    main([str(tmp_path / "m"), "--seed", "1", "--arch", "mistral", "--preset", "micro"])
    cfg = ModelConfig.from_hf_config(json.loads((tmp_path / "m" / "config.json").read_text()))
    assert cfg.architecture == "MistralForCausalLM" and cfg.hidden_size == 64
    with pytest.raises(ValueError, match="unknown preset"):
        write_model(tmp_path / "x", preset="huge")


def test_default_tiny_preset_shape():
    from iterserve.replica.make_model import PRESETS

    tiny = PRESETS["tiny"]
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.num_attention_heads,
            tiny.num_key_value_heads, tiny.head_dim) == (256, 4, 8, 4, 32)
    assert tiny.max_position_embeddings >= 1024 + 512


def test_default_model_path_builds_once_into_the_cache(tmp_path, monkeypatch):
    from iterserve.replica.make_model import default_model_path

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    path = default_model_path(preset="micro")
    assert path.parent == tmp_path / "models" and path.name.endswith("-seed0")
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path(preset="micro") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]  # no temp left


def test_default_model_path_tolerates_a_concurrent_builder(tmp_path, monkeypatch):
    import iterserve.replica.make_model as make_model

    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path))
    real_write = make_model.write_model

    def racing_write(out, **kwargs):  # another process finishes first, mid-build
        final = tmp_path / "models" / f"{make_model.default_model_name('llama', 'micro')}-seed0"
        real_write(final, **kwargs)
        return real_write(out, **kwargs)

    monkeypatch.setattr(make_model, "write_model", racing_write)
    path = make_model.default_model_path(preset="micro")
    assert (path / "config.json").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]
