"""JSON schemas for structured-output tests and benchmarks, generated from a seed.

`assorted_schemas(seed, count)` mixes the features the issue names: nested objects, arrays,
enums, numbers with bounds and required fields. Strings and arrays carry length bounds, as a
real schema for a small model should: an unbounded string lets a model ramble past
max_tokens, and the result is a truncated (finish_reason "length") JSON, not a wrong one.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ("alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "ok")


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("string", "integer", "number", "boolean", "enum", "null_or_int"))
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-100, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice((1, 10, 1000))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(("id", "name", "kind", "score", "tags", "meta", "size", "owner", "ok",
                        "items", "color", "level"), rng.randint(1, 4))
    properties: dict[str, Any] = {}
    for name in names:
        roll = rng.random()
        if depth < 2 and roll < 0.2:
            properties[name] = _object(rng, depth + 1)
        elif depth < 2 and roll < 0.4:
            properties[name] = {"type": "array", "items": _leaf(rng) if rng.random() < 0.7
                                else _object(rng, depth + 1),
                                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
        else:
            properties[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def assorted_schemas(seed: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(count)]


def moderately_complex_schema() -> dict[str, Any]:
    """The overhead benchmark's schema: a nested order with enums, bounds and arrays."""
    return {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "customer": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 16},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            }, "required": ["name", "tier"], "additionalProperties": False},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                }, "required": ["sku", "quantity", "price"], "additionalProperties": False}},
            "gift": {"type": "boolean"},
            "notes": {"anyOf": [{"type": "string", "maxLength": 24}, {"type": "null"}]},
        },
        "required": ["order_id", "customer", "items", "gift"],
        "additionalProperties": False,
    }
