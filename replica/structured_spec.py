"""What a request's output must match: JSON, a JSON schema, a regex, a choice or a grammar.

A `StructuredSpec` is plain data (hashable: it keys the compiled-grammar cache) and says
nothing of tokens; `replica/structured_output.py` compiles it against the tokenizer.
`check_structured_spec` parses it without a tokenizer so the ingress can answer 400 on a bad
schema, regex or grammar before the request is routed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """kind plus its text: a canonical JSON schema, a regex, an EBNF grammar, or for
    "choice" the JSON list of allowed strings. Build with the `from_*` helpers."""

    kind: StructuredKind
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls("json_object")

    @classmethod
    def from_json_schema(cls, schema: dict[str, Any] | str | bool) -> StructuredSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from error
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object")
        # Compact text keys the cache; key order is kept: it is the order fields are generated.
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def from_regex(cls, pattern: str) -> StructuredSpec:
        return cls("regex", pattern)

    @classmethod
    def from_choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredSpec:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def from_grammar(cls, ebnf: str) -> StructuredSpec:
        return cls("grammar", ebnf)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.text)

    def as_ebnf(self) -> str:
        """The choice kind as an EBNF alternation (json.dumps escapes like EBNF literals)."""
        return "root ::= " + " | ".join(json.dumps(c) for c in self.choices)


def check_structured_spec(spec: StructuredSpec) -> None:
    """Parse the spec without a tokenizer; ValueError with xgrammar's reason if it is bad."""
    import xgrammar as xgr  # imported on first use: most requests have no constraint

    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(spec.as_ebnf())
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.text)
    except (RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        # xgrammar prefixes its C++ source location: "[time] file.cc:94: message".
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: "
                         f"{reason.split(': ', 1)[-1]}") from error
