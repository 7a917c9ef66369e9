"""The forced call (tool_choice required / a named function) of the families whose arguments are not
JSON (markup.py): Qwen3-Coder's XML and Gemma 4's notation, as an llguidance Lark grammar over the
family's exact marker tokens. A string value is text (Gemma 4: between its quote tokens) within the
schema's length bounds, or one of its enum values; other values are JSON (`%json` of their schema),
as the templates write them.
"""
from __future__ import annotations

import json
import re

from .markup import types_of
from .notation import GEMMA, QUOTE
from .schema import closed


def call_grammar(fmt, functions: list[dict]) -> str:
    """Lark of one call of one of `functions` in the family's notation, its arguments following the
    function's schema: properties in the schema's order (Gemma 4: sorted, as its template writes
    them), the required ones always, the others optional; a string as text (Gemma 4: between its
    quote tokens) within the schema's length bounds or one of its enum values, other values as JSON."""
    rules: list[str] = []
    start = fmt.start.lark()
    end = fmt.end.lark()
    alternatives = []
    for i, f in enumerate(functions):
        schema = f.get("parameters") or {"type": "object"}
        if fmt.name == GEMMA:
            body = _gemma_object(schema, f"f{i}", rules, fmt)
            alternatives.append(f'{start} {json.dumps("call:" + f["name"])} {body} {end}')
        else:
            params = _xml_params(schema, f"f{i}", rules)
            head = json.dumps("\n<function=" + f["name"] + ">\n")
            alternatives.append(f'{start} {head} {params} "</function>\\n" {end}')
    return "start: " + " | ".join(f"({a})" for a in alternatives) + "\n" + "\n".join(rules) + "\n"


def _sequence(items: list[tuple[str, bool]], sep: str) -> str:
    """A Lark expression of `items` (expression, required) in order, the optional ones left out at
    will, `sep` between two written ones."""
    def after(i: int) -> str:
        if i == len(items):
            return ""
        item, required = items[i]
        head = f"{sep} {item}".strip()
        return (f"{head} {after(i + 1)}" if required else f"({head})? {after(i + 1)}").strip()

    def first(i: int) -> str:
        if i == len(items):
            return ""
        item, required = items[i]
        written = f"{item} {after(i + 1)}".strip()
        if required:
            return written
        rest = first(i + 1)
        return f"({written} | {rest})" if rest else f"({written})?"
    return first(0)


def _string_token(schema: dict, name: str, rules: list[str], forbid: str | None) -> str:
    """A string's text: an enum's values, or any text within minLength / maxLength (without `forbid`)."""
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else \
        [schema["const"]] if "const" in schema else None
    if values is not None and all(isinstance(v, str) for v in values):
        return "(" + " | ".join(json.dumps(v) for v in values) + ")"
    low = schema.get("minLength", 0) if isinstance(schema.get("minLength"), int) else 0
    high = schema.get("maxLength") if isinstance(schema.get("maxLength"), int) else None
    regex = f"/(?s:.{{{low},{'' if high is None else high}}})/"
    if forbid is not None:
        regex += " & ~/(?s:.*)" + re.escape(forbid).replace("/", "\\/") + "(?s:.*)/"
    token = f"S_{name.upper()}"
    rules.append(f"{token}: {regex}")
    return token


def _json_rule(schema, name: str, rules: list[str]) -> str:
    from ...structured import JSON_STYLE
    rule = f"j_{name}"
    rules.append(f"{rule}: %json {json.dumps(dict(closed(schema), **{'x-guidance': dict(JSON_STYLE)}))}")
    return rule


def _xml_params(schema: dict, name: str, rules: list[str]) -> str:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or [])
    items = []
    for j, (key, sub) in enumerate(properties.items()):
        sub = sub if isinstance(sub, dict) else {}
        if types_of(sub) in (["string"], []) and not sub.get("anyOf") and not sub.get("oneOf"):
            value = _string_token(sub, f"{name}_{j}", rules, "</parameter>")
        else:
            value = _json_rule(sub, f"{name}_{j}", rules)
        items.append((f'{json.dumps("<parameter=" + key + ">" + chr(10))} {value} "\\n</parameter>\\n"',
                      key in required))
    return _sequence(items, "") or '""'


def _gemma_value(schema, name: str, rules: list[str], fmt) -> str:
    schema = schema if isinstance(schema, dict) else {}
    types = types_of(schema)
    quote = fmt.inner[0].lark() if fmt.inner else json.dumps(QUOTE)
    if types == ["string"] or (not types and "enum" in schema):
        return f"{quote} {_string_token(schema, name, rules, QUOTE)} {quote}"
    if types == ["object"] and isinstance(schema.get("properties"), dict):
        return _gemma_object(schema, name, rules, fmt)
    if types == ["array"] and isinstance(schema.get("items"), dict):
        item = _gemma_value(schema["items"], name + "_i", rules, fmt)
        return f'"[" ({item} ("," {item})*)? "]"'
    return _json_rule(schema, name, rules)


def _gemma_object(schema: dict, name: str, rules: list[str], fmt) -> str:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or [])
    items = [(f'{json.dumps(key + ":")} {_gemma_value(sub, f"{name}_{j}", rules, fmt)}', key in required)
             for j, (key, sub) in enumerate(sorted(properties.items()))]
    rule = f"o_{name}"
    rules.append(f'{rule}: "{{" {_sequence(items, json.dumps(","))} "}}"')
    return rule
