"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list of strings, an
EBNF grammar, or an xgrammar structural tag (JSON schemas inside fixed text: how forced tool calls are written). Validated when built, without a tokenizer: xgrammar parses the spec into a grammar, so a
bad schema, regex or grammar is refused at the request, naming the field, before it reaches the engine."""
from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from specserve.errors import InvalidRequestError

FIELD = "structured_output"


class StructuredOutputKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # value: the schema (a dict, or its JSON text)
    JSON_OBJECT = "json_object"  # value: None; any JSON object
    REGEX = "regex"  # value: the pattern (xgrammar's regex dialect)
    CHOICE = "choice"  # value: the list of strings the output is one of
    GRAMMAR = "grammar"  # value: an EBNF grammar (GBNF as xgrammar reads it) whose start rule is `root`
    STRUCTURAL_TAG = "structural_tag"  # value: an xgrammar StructuralTag (a dict, or its JSON text)


@dataclass
class StructuredOutput:
    """kind and its value; built once per request (SamplingParams.structured_output). After construction a
    json_schema's value is its JSON text (key order kept: it orders the output's fields), so equal specs have
    equal `key`s (the compile cache's)."""

    kind: StructuredOutputKind
    value: str | list[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StructuredOutputKind):
            kinds = {k.value: k for k in StructuredOutputKind}
            if self.kind not in kinds:
                raise InvalidRequestError(f"{FIELD}.kind", f"must be one of {sorted(kinds)}, got {self.kind!r}")
            self.kind = kinds[self.kind]
        self.value = self._normalized(self.value)
        self.grammar()  # raises on a spec xgrammar cannot parse

    def _normalized(self, value):
        kind, where = self.kind, f"{FIELD}.{self.kind.value}"
        if kind is StructuredOutputKind.JSON_OBJECT:
            if value is not None:
                raise InvalidRequestError(where, "takes no value; use json_schema to constrain the object")
            return None
        if kind in (StructuredOutputKind.JSON_SCHEMA, StructuredOutputKind.STRUCTURAL_TAG):
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(where, f"is not valid JSON ({e}); give it as a JSON object")
            if kind is StructuredOutputKind.STRUCTURAL_TAG and not isinstance(value, dict):
                raise InvalidRequestError(where, f"must be a structural tag (an object), got {type(value).__name__}")
            if not isinstance(value, (dict, bool)):
                raise InvalidRequestError(where, f"must be a JSON schema (an object), got {type(value).__name__}")
            return json.dumps(value, separators=(",", ":"))  # key order kept: it orders the output
        if kind is StructuredOutputKind.CHOICE:
            if (not isinstance(value, (list, tuple)) or not value
                    or any(not isinstance(c, str) or not c for c in value)):
                raise InvalidRequestError(where, f"must be a non-empty list of non-empty strings, got {value!r}")
            return list(value)
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(where, f"must be a non-empty string, got {value!r}")
        return value

    @property
    def key(self) -> tuple[str, str]:
        """Equal for specs that compile to the same grammar."""
        return self.kind.value, json.dumps(self.value)

    def grammar(self):
        """The xgrammar Grammar of this spec (tokenizer-independent); InvalidRequestError naming the field
        where xgrammar cannot parse it."""
        import xgrammar as xgr

        kind = self.kind
        try:
            if kind is StructuredOutputKind.JSON_SCHEMA:
                return xgr.Grammar.from_json_schema(self.value, **JSON_LAYOUT)
            if kind is StructuredOutputKind.JSON_OBJECT:
                return xgr.Grammar.from_json_schema('{"type": "object"}', **JSON_LAYOUT)
            if kind is StructuredOutputKind.REGEX:
                return xgr.Grammar.from_regex(self.value)
            if kind is StructuredOutputKind.CHOICE:
                # JSON string literals are EBNF string literals: the same escapes.
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in self.value))
            if kind is StructuredOutputKind.STRUCTURAL_TAG:
                return xgr.Grammar.from_structural_tag(self.value)
            return xgr.Grammar.from_ebnf(self.value)
        except RuntimeError as e:
            raise InvalidRequestError(f"{FIELD}.{kind.value}", f"is not a valid {_WHAT[kind]}: {_reason(e)}")


# JSON outputs are compact apart from single spaces a model may put between tokens: unbounded whitespace lets
# a weak model fill max_tokens with blanks, which no client wants.
JSON_LAYOUT = dict(any_whitespace=True, max_whitespace_cnt=1)

_WHAT = {StructuredOutputKind.JSON_SCHEMA: "JSON schema xgrammar supports",
         StructuredOutputKind.JSON_OBJECT: "JSON object",
         StructuredOutputKind.REGEX: "regular expression",
         StructuredOutputKind.CHOICE: "list of choices",
         StructuredOutputKind.GRAMMAR: "EBNF grammar (root ::= ...)",
         StructuredOutputKind.STRUCTURAL_TAG: "structural tag xgrammar supports"}


def _reason(error: Exception) -> str:
    """xgrammar's message without its time stamp and source location."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(error)).strip()
