"""The request fields that constrain the output, turned into engine terms (or a 400).

    response_format       {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    guided_json/regex/choice/grammar   vLLM's extras; `structured_outputs` their newer spelling
    tool_choice           "required" or a named function: a JSON schema over the tools
    logit_bias            OpenAI's {"token id": bias}; allowed_token_ids, bad_words (vLLM)

Everything is checked here, before routing: a malformed schema, regex or grammar is a 400
with xgrammar's reason, never a failure inside a replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.deploy.errors import bad_request
from iterserve.replica.structured_spec import StructuredSpec, check_structured_spec

MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's own bound
MAX_ALLOWED_TOKEN_IDS = 100_000
MAX_BAD_WORDS = 100


@dataclass(frozen=True)
class OutputConstraints:
    """The SamplingParams fields this module decides."""

    structured: StructuredSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = field(default=())

    def as_kwargs(self) -> dict[str, Any]:
        return {"structured": self.structured, "logit_bias": self.logit_bias,
                "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words}


def output_constraints(req: Any, vocab_size: int | None,
                       tool_spec: StructuredSpec | None = None) -> OutputConstraints:
    """All constraints of a completion or chat request; `tool_spec` comes from tool_choice."""
    specs = [s for s in (_response_format_spec(req.response_format), _guided_spec(req),
                         _structured_outputs_spec(req.structured_outputs), tool_spec)
             if s is not None]
    if len(specs) > 1:
        raise bad_request("Only one output constraint may be given: response_format, "
                          "guided_*, structured_outputs or a forced tool_choice.")
    spec = specs[0] if specs else None
    if spec is not None:
        try:
            check_structured_spec(spec)
        except ValueError as error:
            raise bad_request(str(error), param="response_format") from error
    return OutputConstraints(
        structured=spec,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        allowed_token_ids=_allowed_token_ids(req.allowed_token_ids, vocab_size),
        bad_words=_bad_words(req.bad_words),
    )


def _response_format_spec(response_format: dict[str, Any] | None) -> StructuredSpec | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body and "json_schema" not in body:
            raise bad_request("response_format json_schema needs {'json_schema': {'name': ..., "
                              "'schema': {...}}}", param="response_format")
        schema = body.get("schema", body.get("json_schema"))
        return _schema_spec(schema, "response_format")
    raise bad_request(f"response_format type must be text, json_object or json_schema; got "
                      f"{kind!r}", param="response_format")


def _schema_spec(schema: Any, param: str) -> StructuredSpec:
    try:
        return StructuredSpec.from_json_schema(schema)
    except ValueError as error:
        raise bad_request(str(error), param=param) from error


def _guided_spec(req: Any) -> StructuredSpec | None:
    given = [(name, getattr(req, name)) for name in
             ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
             if getattr(req, name) is not None]
    if len(given) > 1:
        raise bad_request("Give at most one of guided_json, guided_regex, guided_choice, "
                          "guided_grammar.")
    if not given:
        return None
    return _spec_of(*given[0])


def _structured_outputs_spec(options: dict[str, Any] | None) -> StructuredSpec | None:
    if not options:
        return None
    names = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
             "grammar": "guided_grammar"}
    given = [(names[k], v) for k, v in options.items() if k in names and v is not None]
    if options.get("json_object"):
        given.append(("json_object", True))
    if len(given) != 1:
        raise bad_request("structured_outputs takes exactly one of json, regex, choice, "
                          "grammar or json_object.", param="structured_outputs")
    return _spec_of(*given[0])


def _spec_of(name: str, value: Any) -> StructuredSpec:
    try:
        if name == "json_object":
            return StructuredSpec.json_object()
        if name == "guided_json":
            return StructuredSpec.from_json_schema(value)
        if name == "guided_choice":
            return StructuredSpec.from_choice(value)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string")
        if name == "guided_regex":
            return StructuredSpec.from_regex(value)
        return StructuredSpec.from_grammar(value)
    except ValueError as error:
        raise bad_request(str(error), param=name) from error


def _check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    if any(t < 0 for t in ids):
        raise bad_request(f"{param}: token ids must be >= 0.", param=param)
    if vocab_size is not None and any(t >= vocab_size for t in ids):
        raise bad_request(f"{param}: token ids must be < the vocabulary size {vocab_size}.",
                          param=param)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None
                ) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries.",
                          param="logit_bias")
    pairs = []
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError as error:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.",
                              param="logit_bias") from error
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}.",
                              param="logit_bias")
        pairs.append((token_id, float(value)))
    _check_token_ids([t for t, _ in pairs], vocab_size, "logit_bias")
    return tuple(pairs)


def _allowed_token_ids(ids: list[int] | None, vocab_size: int | None) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS:
        raise bad_request(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} ids.",
                          param="allowed_token_ids")
    _check_token_ids(ids, vocab_size, "allowed_token_ids")
    return tuple(ids)


def _bad_words(words: list[str] | None) -> tuple[str, ...]:
    if not words:
        return ()
    if len(words) > MAX_BAD_WORDS or any(not w for w in words):
        raise bad_request(f"bad_words takes at most {MAX_BAD_WORDS} non-empty strings.",
                          param="bad_words")
    return tuple(words)

