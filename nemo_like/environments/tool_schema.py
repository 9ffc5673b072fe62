"""Strict JSON-schema checking of a tool call's arguments: the subset of JSON schema that tool
parameters use (types, enum, bounds, lengths, items, properties, required, additionalProperties)."""

from __future__ import annotations

import json
import math
from typing import Any

# Deeper schemas or values are refused rather than recursed into (model output is untrusted).
MAX_SCHEMA_DEPTH = 16


def _type_ok(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if t == "string":
        return isinstance(value, str)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "array":
        return isinstance(value, list)
    if t == "object":
        return isinstance(value, dict)
    if t == "null":
        return value is None
    return False


def _json_type_name(value: Any) -> str:
    for t in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _type_ok(value, t):
            return t
    return type(value).__name__


def _validate(value: Any, schema: dict[str, Any], path: str, depth: int) -> str | None:
    if depth > MAX_SCHEMA_DEPTH:
        return f"{path}: nested too deeply"
    t = schema.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        if not any(_type_ok(value, x) for x in ts):
            want = " or ".join(ts)
            return f"{path} must be {want}, got {_json_type_name(value)}"
    if "enum" in schema and not any(_same_json(value, e) for e in schema["enum"]):
        return f"{path} must be one of {json.dumps(schema['enum'])[:100]}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{path} must be >= {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{path} must be <= {schema['maximum']}"
    if isinstance(value, str) and "maxLength" in schema and len(value) > schema["maxLength"]:
        return f"{path} is longer than {schema['maxLength']} characters"
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            return f"{path} has more than {schema['maxItems']} items"
        items = schema.get("items")
        if isinstance(items, dict):
            for i, v in enumerate(value):
                err = _validate(v, items, f"{path}[{i}]", depth + 1)
                if err:
                    return err
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for k in schema.get("required") or []:
            if k not in value:
                return f"missing argument {k!r}" if depth == 0 else f"{path}: missing key {k!r}"
        if schema.get("additionalProperties") is False:
            extra = [k for k in value if k not in props]
            if extra:
                what = "unexpected argument" if depth == 0 else f"{path}: unexpected key"
                return f"{what} {str(extra[0])[:50]!r}"
        for k, v in value.items():
            if k in props:
                err = _validate(v, props[k], f"argument {k!r}" if depth == 0 else f"{path}.{k}", depth + 1)
                if err:
                    return err
    return None


def _same_json(a: Any, b: Any) -> bool:
    try:
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    except (TypeError, ValueError):
        return False


def validate_arguments(arguments: Any, parameters: dict[str, Any]) -> str | None:
    """None if ``arguments`` satisfy the ``parameters`` schema, else a short error message. Never raises.

    Types are JSON types, strictly: ``1.0`` is not an integer, ``true`` is not a number.
    """
    try:
        if not isinstance(arguments, dict):
            return f"arguments must be an object, got {_json_type_name(arguments)}"
        return _validate(arguments, parameters, "arguments", 0)
    except Exception as e:  # e.g. RecursionError on pathological input
        return f"arguments could not be validated ({type(e).__name__})"
