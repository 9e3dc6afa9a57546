"""The JSON-schema subset validator and reply parsing."""
import pytest

from operators.llm.schema import parse_json_reply, schema_errors

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "scores"],
          "properties": {"name": {"type": "string", "minLength": 2},
                         "kind": {"type": "string", "enum": ["a", "b"]},
                         "note": {"type": ["string", "null"]},
                         "scores": {"type": "array", "minItems": 2, "maxItems": 3,
                                    "items": {"type": "integer", "minimum": 1, "maximum": 10}}}}


def test_valid():
    assert schema_errors({"name": "ok", "scores": [1, 10], "kind": "a", "note": None}, SCHEMA) == []


@pytest.mark.parametrize("value,fragment", [
    ({"scores": [1, 2]}, "missing required 'name'"),
    ({"name": "ok", "scores": [1]}, "at least 2"),
    ({"name": "ok", "scores": [1, 2, 3, 4]}, "at most 3"),
    ({"name": "ok", "scores": [0, 2]}, "minimum"),
    ({"name": "ok", "scores": [1, 11]}, "maximum"),
    ({"name": "ok", "scores": [1, 2.5]}, "expected integer"),
    ({"name": "ok", "scores": [1, True]}, "expected integer"),
    ({"name": "ok", "scores": [1, 2], "extra": 1}, "unexpected"),
    ({"name": "ok", "scores": [1, 2], "kind": "c"}, "not one of"),
    ({"name": " ", "scores": [1, 2]}, "shorter"),
    ([], "expected object"),
])
def test_violations(value, fragment):
    errors = schema_errors(value, SCHEMA)
    assert errors and any(fragment in e for e in errors), errors


def test_parse_json_reply_variants():
    assert parse_json_reply('{"a": 1}') == {"a": 1}
    assert parse_json_reply('```json\n{"a": 1}\n```') == {"a": 1}
    assert parse_json_reply('Here you go: {"a": [1, 2]} hope it helps') == {"a": [1, 2]}
    for bad in ["", "no json here", '{"a": 1', '{"a": 1 ...(truncated']:
        with pytest.raises(ValueError):
            parse_json_reply(bad)
