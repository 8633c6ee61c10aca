"""JSON schemas the structured-output tests constrain SmolLM2 to (shared by the engine
and the Serve tests): objects, arrays with min/max items, enums, nested objects, numbers
with bounds, booleans, strings with maxLength, $ref. Every string is bounded, so a
sampled answer ends well within the tests' max_tokens."""

NAME = {"type": "string", "maxLength": 12}

SCHEMAS = {
    "object": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": 1, "maximum": 10},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["score", "ratio"],
        "additionalProperties": False,
    },
    "boolean": {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    },
    "max_length": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 8}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "ref": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99},
                "done": {"type": "boolean"},
            },
            "required": ["id", "done"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "city": NAME,
            "country": {"enum": ["FR", "DE", "IT"]},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}

PROMPT = "Answer in JSON. Describe something you like."


def compact(text: str) -> bool:
    """Whether JSON `text` is written as compact JSON with single spaces: outside strings,
    no whitespace but one space right after each `,` and `:` (json.dumps' separators)."""
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (False, in_string) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch.isspace() and not (
            ch == " " and i > 0 and text[i - 1] in ",:" and not text[i + 1 : i + 2].isspace()
        ):
            return False
    return True
