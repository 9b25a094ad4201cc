"""Request fields that constrain the output -> one StructuredOutputSpec.

    response_format      {"type": "text"} | {"type": "json_object"} |
                         {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json          a JSON schema (object, or its JSON text)        vLLM extensions
    guided_regex         a regex
    guided_choice        a list of strings
    guided_grammar       EBNF as xgrammar reads it (root rule `root`)
    structured_outputs   {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM's newer form)

At most one constraint per request. The shape of each field is checked here
(a 400 naming it); whether the schema, regex or grammar compiles is decided
by the engine core, whose error comes back as a 400 naming the same field
(StructuredOutputSpec.param). This module stays torch-free: the API process
never imports xgrammar.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler.types import StructuredOutputSpec
from server.errors import APIError, invalid_field

_BACKENDS = (None, "auto", "xgrammar")
# structured_outputs keys that only tune vLLM's own backends: accepted, no effect
_NO_OP_KEYS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "backend")


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text -> JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise invalid_field(param, f"{param} is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise invalid_field(param, f"{param} must be a JSON schema (an object), got {type(value).__name__}")
    return json.dumps(value)


def _spec(kind: str, value: Any, param: str) -> StructuredOutputSpec:
    if kind == "json":
        return StructuredOutputSpec("json", _schema_text(value, param), param)
    if kind == "json_object":
        return StructuredOutputSpec("json_object", "", param)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise invalid_field(param, f"{param} must be a non-empty string")
        return StructuredOutputSpec(kind, value, param)
    # choice
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise invalid_field(param, f"{param} must be a non-empty list of strings")
    if any(c == "" for c in value):
        raise invalid_field(param, f"{param} entries must be non-empty strings")
    return StructuredOutputSpec("choice", json.dumps(value), param)


def _from_response_format(rf: Any) -> StructuredOutputSpec | None:
    if not isinstance(rf, dict):
        raise invalid_field("response_format", "response_format must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("json_object", None, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise invalid_field("response_format.json_schema",
                                'response_format.json_schema must be an object {"name", "schema", "strict"}')
        if js.get("schema") is None:  # no schema: any JSON object
            return _spec("json_object", None, "response_format.json_schema")
        return _spec("json", js["schema"], "response_format.json_schema.schema")
    raise invalid_field("response_format.type",
                        f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def _from_structured_outputs(so: Any) -> StructuredOutputSpec | None:
    if not isinstance(so, dict):
        raise invalid_field("structured_outputs", "structured_outputs must be an object")
    found: list[StructuredOutputSpec] = []
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if key in _NO_OP_KEYS or value is None:
            continue
        if key in ("json", "regex", "choice", "grammar"):
            found.append(_spec(key, value, param))
        elif key == "json_object":
            if value is True:
                found.append(_spec("json_object", None, param))
        elif key == "whitespace_pattern":
            raise APIError(f"{param} is not supported by this server", param=param, code="unsupported_parameter")
        else:
            raise invalid_field(param, f"{param} is not a structured output: use json, regex, choice, grammar "
                                       "or json_object")
    if len(found) > 1:
        raise invalid_field(found[1].param, "structured_outputs must give exactly one of json, regex, choice, "
                                            "grammar, json_object")
    return found[0] if found else None


def structured_output_spec(req: Any) -> StructuredOutputSpec | None:
    """The request's output constraint, or None. 400 (naming the field) for
    a malformed one or for more than one."""
    if req.guided_decoding_backend not in _BACKENDS:
        raise APIError(f"guided_decoding_backend {req.guided_decoding_backend!r} is not available; this server "
                       "uses xgrammar", param="guided_decoding_backend", code="unsupported_parameter")
    if req.guided_whitespace_pattern is not None:
        raise APIError("guided_whitespace_pattern is not supported by this server: JSON is generated compactly",
                       param="guided_whitespace_pattern", code="unsupported_parameter")
    candidates: list[StructuredOutputSpec] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            candidates.append(spec)
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            candidates.append(_spec(kind, value, field))
    if req.structured_outputs is not None:
        spec = _from_structured_outputs(req.structured_outputs)
        if spec is not None:
            candidates.append(spec)
    if len(candidates) > 1:
        first, second = candidates[0].param.split(".")[0], candidates[1].param.split(".")[0]
        raise invalid_field(second, f"{second} cannot be combined with {first}: give one output constraint")
    return candidates[0] if candidates else None
