"""pydantic models of the bodies of /v1/models, /tokenize and /detokenize (the generation
endpoints' bodies are in schemas.py, whose base classes these share)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from iterserve.deploy.schemas import ChatMessage, TokenId, _Body, _Out, now_s


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "iterserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("pass exactly one of prompt or messages")
        return self


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(min_length=0)


class DetokenizeResponse(_Out):
    prompt: str
