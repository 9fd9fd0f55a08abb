"""Build the engine's Tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF holds no tokenizer.json: it stores the vocabulary, merges, token types, special ids and
the chat template as metadata. Only llama.cpp's "gpt2" model (byte-level BPE) is supported. The
pieces are assembled with the `tokenizers` library the way transformers assembles them when it
loads a GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so both give the same ids:
the split regex chosen by `tokenizer.ggml.pre` (GPT-2's byte-level regex for names it does not
list), control tokens (type 3) added as special tokens, user-defined ones (type 4) as plain
added tokens, and BOS prepended only when `tokenizer.ggml.add_bos_token` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from iterserve.replica.gguf_loader import open_gguf

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex; names not listed use GPT-2's regex (as transformers does).
PRE_TOKENIZER_SPLITS = {
    "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "llama-bpe": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT, "pixtral": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (the alphabet byte-level vocabularies use)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes), strict=True))


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id; a token not spelled in the byte alphabet is respelled byte by byte."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    return {(token if set(token) <= alphabet
             else "".join(spelling[b] for b in token.encode("utf-8"))): index
            for index, token in enumerate(tokens)}


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def gguf_backend(path: str | Path) -> Backend:
    """The `tokenizers` backend the file's metadata describes."""
    file = open_gguf(path)
    kind = file.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} in {file.path}; supported: "
                         f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE)")
    tokens = list(file.require("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ")) for m in file.require("tokenizer.ggml.merges")]
    types = list(file.get("tokenizer.ggml.token_type") or [])
    backend = Backend(models.BPE(vocab=_vocab(tokens), merges=merges, dropout=None,
                                 continuing_subword_prefix="", end_of_word_suffix="",
                                 fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(file.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    alphabet = set(_bytes_to_unicode().values())
    # A control token outside the byte alphabet is a llama.cpp mislabel: adding it would grow
    # the vocabulary past the model's, so it is skipped (as transformers does).
    backend.add_special_tokens([
        AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED])
    bos_id = file.get("tokenizer.ggml.bos_token_id")
    if file.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, int(bos_id))])
    return backend


@dataclass(frozen=True)
class GgufTokenizer:
    """What a GGUF file says of its tokenizer: `Tokenizer`'s fields (`Tokenizer.from_pretrained`
    builds one from these)."""

    backend: Backend
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None
    extra_eos_token_ids: tuple[int, ...]


def gguf_tokenizer(path: str | Path) -> GgufTokenizer:
    """The backend, BOS/EOS from their ids, and `tokenizer.chat_template`."""
    file = open_gguf(path)
    backend = gguf_backend(path)
    tokens = file.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = file.get(key)
        return None if index is None else tokens[int(index)]

    eot = file.get("tokenizer.ggml.eot_token_id")
    return GgufTokenizer(
        backend,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        chat_template=file.get("tokenizer.chat_template"),
        extra_eos_token_ids=() if eot is None else (int(eot),),
    )
