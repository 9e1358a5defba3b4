"""Turn pydantic's JSON Schema into a Kubernetes structural schema, and check one.

A structural schema (what CRDs require) has a type on every node and no ``$ref``, ``allOf``,
``oneOf`` or ``not``; ``anyOf`` only beside ``x-kubernetes-int-or-string``. This module also
applies a schema's defaults the way the apiserver does, which lets tests check that the CRD's
defaults give the same object as the models' defaults.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

JsonObject = dict[str, Any]

_DROPPED = ("title", "$defs")
_FORBIDDEN = ("$ref", "allOf", "oneOf", "not", "definitions", "const", "propertyNames")
_ORDER = (
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "required",
    "properties",
    "additionalProperties",
    "items",
    "x-kubernetes-validations",
)
_VALIDATIONS = "x-kubernetes-validations"
_RULE_ORDER = ("rule", "message", "messageExpression", "fieldPath", "reason")


def _merge(base: JsonObject, over: JsonObject) -> JsonObject:
    """`over` wins, except that CEL rules of both are kept."""
    merged = {**base, **over}
    rules = [*base.get(_VALIDATIONS, []), *over.get(_VALIDATIONS, [])]
    if rules:
        merged[_VALIDATIONS] = rules
    return merged


def _resolve(node: JsonObject, defs: JsonObject) -> JsonObject:
    while "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        rest = {k: v for k, v in node.items() if k != "$ref"}
        node = _merge(defs[name], rest)
    if "anyOf" in node:
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("x-kubernetes-int-or-string"):
            return rest
        branches = [b for b in node["anyOf"] if b != {"type": "null"}]
        if len(branches) != 1:
            raise ValueError(f"cannot make a structural schema of anyOf {node['anyOf']!r}")
        node = _merge(_resolve(branches[0], defs), rest)
    return node


def to_structural(schema: JsonObject, defs: JsonObject | None = None) -> JsonObject:
    """A structural copy of a pydantic JSON schema (``$ref`` inlined, nullability dropped)."""
    defs = schema.get("$defs", {}) if defs is None else defs
    node = _resolve(schema, defs)
    out: JsonObject = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key in _FORBIDDEN:
            raise ValueError(f"{key} has no place in a structural schema")
        if key == "exclusiveMinimum" or key == "exclusiveMaximum" or key == "uniqueItems":
            raise ValueError(f"{key} is not supported: use minimum/maximum, list-type set")
        if key == "additionalProperties" and isinstance(value, bool):
            # false: the apiserver prunes unknown fields (the models forbid them);
            # true: free-form maps carry x-kubernetes-preserve-unknown-fields instead.
            continue
        if key == "default" and value is None:
            continue
        if key == "description":
            value = " ".join(str(value).split())
        elif key == "properties":
            value = {name: to_structural(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties"):
            value = to_structural(value, defs)
        elif key == _VALIDATIONS:
            value = [_ordered(rule, _RULE_ORDER) for rule in value]
        out[key] = value
    return _ordered(out, _ORDER)


def _ordered(mapping: JsonObject, order: tuple[str, ...]) -> JsonObject:
    """Keys in a readable order (pydantic sorts them alphabetically)."""
    out = {key: mapping[key] for key in order if key in mapping}
    out.update({key: value for key, value in mapping.items() if key not in out})
    return out


def apply_defaults(value: Any, schema: JsonObject) -> Any:
    """`value` with the schema's defaults filled in, as the apiserver does (recursively)."""
    value = copy.deepcopy(value)
    _default_in_place(value, schema)
    return value


def _default_in_place(value: Any, schema: JsonObject) -> None:
    if isinstance(value, dict):
        properties: JsonObject = schema.get("properties", {})
        for name, prop in properties.items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
        for name, item in value.items():
            if name in properties:
                _default_in_place(item, properties[name])
            elif isinstance(schema.get("additionalProperties"), dict):
                _default_in_place(item, schema["additionalProperties"])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_in_place(item, schema["items"])


def walk(schema: JsonObject, path: str = "") -> Iterator[tuple[str, JsonObject]]:
    """Every node of the schema with its path (``.spec.ipvs.scheduler``, ``[]`` for items)."""
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from walk(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def structural_problems(schema: JsonObject) -> list[str]:
    """Why `schema` is not structural, or is missing descriptions; empty when it is fine.

    The root's ``metadata`` needs no description: the apiserver forbids anything but its type.
    """
    problems: list[str] = []
    for path, node in walk(schema):
        where = path or "<root>"
        special = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        if "type" not in node and not special:
            problems.append(f"{where}: no type")
        for key in (*_FORBIDDEN, "anyOf"):
            if key in node and not (key == "anyOf" and node.get("x-kubernetes-int-or-string")):
                problems.append(f"{where}: {key}")
        if node.get("type") == "object" and "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: both properties and additionalProperties")
        for name, prop in node.get("properties", {}).items():
            if not prop.get("description") and not (path == "" and name == "metadata"):
                problems.append(f"{where}.{name}: no description")
    return problems
