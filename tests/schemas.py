"""Twenty JSON schemas for grammar-constrained decoding tests: nested objects, enums, arrays, numbers with
bounds, required fields. Strings are bounded (patterns, enums) so a random model's output ends within a
test's few tokens. Not maxLength: xgrammar 0.2.8 lets a length-bounded string hold raw control characters,
which JSON forbids (a random model picks them)."""

NAME = {"type": "string", "pattern": "^[A-Za-z]{1,4}$"}

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": -5,
                                                                        "maximum": 5}, "minItems": 1, "maxItems": 3}},
     "required": ["xs"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]},
                                      "score": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["level", "score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 2}}, "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000},
        "role": {"enum": ["admin", "user"]}}, "required": ["id", "role"]}}, "required": ["user"]},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["p"]},
    {"type": "object", "properties": {"t": {"type": "number", "minimum": -40, "maximum": 50}}, "required": ["t"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["flag", "note"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["n"]},
        "minItems": 1, "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "day": {"enum": [1, 2, 3]}},
     "required": ["kind", "day"]},
    {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]}, "qty": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9},
                                      "gift": {"type": "boolean"}}, "required": ["size", "qty", "gift"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"name": NAME, "friends": {"type": "array", "items": NAME, "maxItems": 2}},
     "required": ["name", "friends"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}, "meta": {"type": "object", "properties": {
            "v": {"type": "integer", "minimum": 1, "maximum": 2}}, "required": ["v"]}},
     "required": ["answer", "confidence", "meta"]},
]
assert len(SCHEMAS) == 20
