"""What a request asks its output to match: a JSON schema, any JSON object, a regex or a grammar.

:func:`grammar_spec` turns the four user-facing fields (``SamplingParams(json_schema=...,
json_object=..., regex=..., grammar=...)``, the CLI's flags, the server's ``response_format``)
into one :class:`GrammarSpec`, or None when none is set. It checks only the shape here (types,
at most one, a schema that parses); whether the schema or grammar compiles is the compiler's
question (speclm.structured.compiler), asked once per distinct spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import SpeclmError

Kind = Literal["json_schema", "json_object", "regex", "grammar"]


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint. ``source`` is text (a schema as compact JSON, its key order kept:
    properties are generated in that order), so equal constraints compare and hash equal and
    share one compiled grammar."""

    kind: Kind
    source: str  # the schema (JSON text), the regex, or the grammar (Lark or GBNF); "" for json_object

    @property
    def label(self) -> str:
        """A short name for stats and logs."""
        return {"json_schema": "JSON schema", "json_object": "JSON object"}.get(self.kind, self.kind)


def grammar_spec(json_schema: Any = None, json_object: bool = False, regex: str | None = None,
                 grammar: str | None = None) -> GrammarSpec | None:
    """The constraint these fields ask for (None: unconstrained), or :class:`SpeclmError`.

    json_schema: a dict, or its JSON text; json_object: any JSON object; regex: the whole output
    matches it (Rust regex syntax); grammar: a Lark-style grammar (llguidance's dialect, with
    ``%json`` and regex terminals) or a llama.cpp GBNF grammar, whose start rule is ``start``
    (Lark) or ``root`` (GBNF).
    """
    given = [name for name, value in (("json_schema", json_schema), ("regex", regex),
                                      ("grammar", grammar)) if value is not None]
    if json_object not in (True, False):
        raise SpeclmError(f"json_object must be True or False, got {json_object!r}")
    if json_object:
        given.append("json_object")
    if len(given) > 1:
        raise SpeclmError(f"give at most one of json_schema, json_object, regex and grammar "
                          f"(got {' and '.join(given)})")
    if not given:
        return None
    if json_object:
        return GrammarSpec("json_object", "")
    if json_schema is not None:
        return GrammarSpec("json_schema", _schema_text(json_schema))
    name, value = ("regex", regex) if regex is not None else ("grammar", grammar)
    if not isinstance(value, str):
        raise SpeclmError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise SpeclmError(f"the {name} is empty")
    return GrammarSpec(name, value)


def _schema_text(schema: Any) -> str:
    """A JSON schema (dict, bool or JSON text) as compact JSON text, in its own key order."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SpeclmError(f"the JSON schema is not valid JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno}") from None
    if isinstance(schema, bool):  # true: anything; false: nothing (refused by the compiler)
        return json.dumps(schema)
    if not isinstance(schema, dict):
        raise SpeclmError(f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise SpeclmError(f"the JSON schema cannot be written as JSON: {exc}") from None
