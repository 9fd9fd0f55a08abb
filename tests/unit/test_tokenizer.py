"""Tokenizer over the committed byte-level BPE: round trips, special ids, chat template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from iterserve.replica.make_model import (
    BOS,
    EOS_TEXT,
    EOT,
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    write_model,
)
from iterserve.replica.tokenizer import ChatTemplateError, Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2 + 2?\n"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks."},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tok"), arch="llama", preset="micro")


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(folder)


def test_committed_tokenizer_is_small_and_has_the_special_tokens():
    assert TOKENIZER_FILE.stat().st_size < 1_000_000
    tokens = {t["content"]: t for t in json.loads(TOKENIZER_FILE.read_text())["added_tokens"]}
    assert set(SPECIAL_TOKENS) <= set(tokens) and all(t["special"] for t in tokens.values())


@pytest.mark.parametrize("text", [
    "Return a new list of the items, sorted.", "  leading and trailing  ", "",
    "naïve café, 中文, emoji 🎉🙂, math ∑ x² and tabs\tand\nnewlines",
])
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_add_special_tokens_prepends_bos(tok):
    plain = tok.encode("hello world", add_special_tokens=False)
    assert tok.encode("hello world") == [tok.bos_token_id, *plain]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.decode(tok.encode("hello world"), skip_special_tokens=False) == BOS + "hello world"


def test_common_words_are_single_tokens(tok):
    # Trained on English docstrings, so frequent words are merged rather than spelled out.
    assert len(tok.encode(" the list of", add_special_tokens=False)) == 3


def test_special_ids_vocab_and_eos(tok):
    assert tok.vocab_size == 4096
    assert tok.all_special_ids == {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    # eot from tokenizer_config, end_of_text and eot from generation_config
    assert tok.eos_token_ids == {tok.token_to_id(EOT), tok.token_to_id(EOS_TEXT)}


def test_eos_from_generation_config_is_merged(folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 42}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == {42, tok.token_to_id(EOT)}


def test_chat_template_llama3_layout(tok):
    text = tok.apply_chat_template(MESSAGES[:2])
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=False).endswith("\n\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.token_to_id("<|start_header_id|>") in ids


def test_chat_template_matches_transformers(folder, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for add in (True, False):
        expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=add, tokenize=False)
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=add) == expected
    text = "Some text, with é and 中 and <|eot_id|> inside."
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


def test_raise_exception_in_template(folder, tmp_path):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('first message must be from the user') }}{% endif %}"
                "{{ messages | tojson }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == (
        '[{"role": "user", "content": "é<b>"}]')


def test_sandbox_blocks_attribute_escapes(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(ChatTemplateError, match="unsafe") as info:
        Tokenizer.from_pretrained(tmp_path).apply_chat_template(MESSAGES)
    assert isinstance(info.value.__cause__, jinja2.exceptions.SecurityError)


def test_no_chat_template(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == frozenset()
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        tok.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
