"""`iterserve export-tokenizer`: HF transformers loads the folder and tokenizes as we do."""

from __future__ import annotations

from pathlib import Path

import pytest

from iterserve.deploy import cli
from iterserve.replica.make_model import write_model
from iterserve.replica.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "naïve café — 東京 🚀 ünïcödé",
    "digits 3.14159 2026-12-01 1e-3 0x1F",
    "def f(x):\n    return {'a': [1, 2]}\t# code\n",
    "   leading, trailing   and    runs of  spaces\n\n\n",
    "",
]


def test_exported_tokenizer_matches_the_engine(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    model = write_model(tmp_path / "model", seed=1)
    out = tmp_path / "tok"
    assert cli.main(["export-tokenizer", str(out), "--model", str(model)]) == 0
    assert "tokenizer_config.json" in capsys.readouterr().out
    ours = Tokenizer.from_pretrained(model)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == ids  # lm-eval's default: add_special_tokens
        assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text, False)
        assert hf.decode(ids) == ours.decode(ids, skip_special_tokens=False)
    assert hf.eos_token == ours.eos_token and hf.bos_token == ours.bos_token
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ours.apply_chat_template(messages))


def test_exported_builtin_tokenizer_matches_the_engine(tmp_path: Path) -> None:
    """The built-in model's tokenizer (read from its GGUF file) round-trips through HF."""
    from iterserve.deploy.engine_client import load_tokenizer

    try:
        ours = load_tokenizer(None)
    except FileNotFoundError:
        pytest.skip("the built-in model is not installed (scripts/install.sh installs it)")
    assert cli.main(["export-tokenizer", str(tmp_path)]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ours.apply_chat_template(messages))
