"""Structured replies: a JSON-schema validator for the subset we send, and tolerant JSON extraction.

We validate every reply ourselves (endpoints in JSON mode, and some in schema mode, do not enforce the
schema). The subset: type (incl. lists with "null"), properties, required, additionalProperties
(false), items, minItems, maxItems, enum, minimum, maximum, minLength, maxLength. Anything else in a
schema is ignored, which errs on accepting the reply.
"""
from __future__ import annotations

import json
import re
from typing import Any

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def schema_errors(value: Any, schema: dict, path: str = "$", limit: int = 5) -> list[str]:
    """Readable violations of ``schema`` by ``value`` (empty list: valid). Stops after ``limit``."""
    errors: list[str] = []
    _check(value, schema, path, errors, limit)
    return errors


def _check(value: Any, schema: dict, path: str, errors: list[str], limit: int) -> None:
    if len(errors) >= limit:
        return
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_TYPES.get(k, lambda v: True)(value) for k in kinds):
            errors.append(f"{path}: expected {'/'.join(kinds)}, got {type(value).__name__}")
            return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not one of {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}: missing required {name!r}")
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(props))
            if extra:
                errors.append(f"{path}: unexpected {extra}")
        for name, sub in props.items():
            if name in value:
                _check(value[name], sub, f"{path}.{name}", errors, limit)
    elif isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{path}: {len(value)} items, at least {schema['minItems']} required")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: {len(value)} items, at most {schema['maxItems']} allowed")
        if "items" in schema:
            for i, v in enumerate(value):
                _check(v, schema["items"], f"{path}[{i}]", errors, limit)
    elif isinstance(value, str):
        if "minLength" in schema and len(value.strip()) < schema["minLength"]:
            errors.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def parse_json_reply(text: str | None) -> Any:
    """The JSON object in a model reply. Tolerates a Markdown code fence and prose around one object
    (JSON mode on some endpoints); raises ``ValueError`` when there is no parseable object."""
    if not text or not text.strip():
        raise ValueError("empty reply")
    m = _FENCE.match(text)
    if m:
        text = m.group(1)
    try:
        return json.loads(text)
    except ValueError:
        start = text.find("{")
        if start < 0:
            raise ValueError("reply contains no JSON object") from None
        try:
            return json.JSONDecoder().raw_decode(text[start:])[0]
        except ValueError as exc:
            raise ValueError(f"reply is not valid JSON: {exc.msg} at char {exc.pos}") from None


# Keywords strict mode accepts (OpenAI's structured outputs); others are dropped from what is sent and
# still checked here, on the reply.
_STRICT_KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum", "description",
                    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                    "minItems", "maxItems", "pattern", "format", "anyOf", "const", "title"}


def strict_schema(schema: dict) -> dict | None:
    """The schema as strict mode wants it: every object closed (``additionalProperties: false``) with
    every property required (optional ones become nullable), unsupported keywords dropped. None when
    the root is not an object (strict mode needs one)."""
    if schema.get("type") != "object":
        return None
    return _strict(schema)


def _strict(schema: dict) -> dict:
    out = {k: v for k, v in schema.items() if k in _STRICT_KEYWORDS}
    if "items" in out and isinstance(out["items"], dict):
        out["items"] = _strict(out["items"])
    if "anyOf" in out:
        out["anyOf"] = [_strict(s) for s in out["anyOf"]]
    if out.get("type") == "object" or "properties" in out:
        props = out.get("properties", {})
        required = set(schema.get("required", []))
        new_props = {}
        for name, sub in props.items():
            sub = _strict(sub)
            if name not in required and "type" in sub:
                kinds = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
                sub["type"] = kinds + (["null"] if "null" not in kinds else [])
            new_props[name] = sub
        out["properties"] = new_props
        out["required"] = list(new_props)
        out["additionalProperties"] = False
    return out
