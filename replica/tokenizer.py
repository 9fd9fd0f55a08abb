"""Tokenizer: HF `tokenizer.json` via the `tokenizers` library, plus the chat template.

No transformers at runtime. The chat template is rendered the way transformers renders it:
a sandboxed jinja2 environment with trim_blocks/lstrip_blocks, `raise_exception`, `tojson`
and `strftime_now`, and the variables messages, add_generation_prompt, bos_token, eos_token.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from iterserve.replica.loader import read_generation_config, read_json
from iterserve.replica.model_source import is_gguf


class ChatTemplateError(ValueError):
    """The template rejected the messages (raise_exception, a render error), or is absent."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which templates do not expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._extra_eos = extra_eos_token_ids

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and generation_config.json of a folder,
        or the tokenizer metadata of a GGUF file."""
        if is_gguf(path):
            from iterserve.replica.gguf_tokenizer import gguf_tokenizer  # torch: only for GGUF

            fields = gguf_tokenizer(path)
            return cls(fields.backend, bos_token=fields.bos_token, eos_token=fields.eos_token,
                       chat_template=fields.chat_template,
                       extra_eos_token_ids=fields.extra_eos_token_ids)
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder} (only the fast-tokenizer "
                                    "format is supported)")
        backend = tokenizers.Tokenizer.from_file(str(file))
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        jinja_file = folder / "chat_template.jinja"  # where newer transformers saves it
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=template,
            extra_eos_token_ids=read_generation_config(folder).eos_token_ids,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens adds what tokenizer.json's post-processor adds (e.g. BOS).

        Text from apply_chat_template already holds its BOS: encode it with False.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages to prompt text; extra kwargs become template variables (tools...)."""
        template = self._compiled_template
        if template is None:
            raise ChatTemplateError("this tokenizer has no chat_template; send a completion "
                                    "request instead")
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
            )
        except jinja2.TemplateError as error:  # undefined names, sandbox violations: bad input
            raise ChatTemplateError(f"the chat template failed: {error}") from error

    @cached_property
    def _compiled_template(self) -> jinja2.Template | None:
        return None if self.chat_template is None else compile_chat_template(self.chat_template)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included. The model's embedding
        may be larger (padded); size logits by the model config, not by this."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(i for i, token in self.backend.get_added_tokens_decoder().items()
                         if token.special)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """tokenizer_config's eos_token together with generation_config's eos_token_id(s)."""
        ids = set(self._extra_eos)
        if self.eos_token is not None:
            eos_id = self.backend.token_to_id(self.eos_token)
            if eos_id is not None:
                ids.add(eos_id)
        return frozenset(ids)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)
