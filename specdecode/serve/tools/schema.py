"""A tool's JSON schema as the grammar engine can compile it: the keywords llguidance does not
implement (its "Unimplemented keys", e.g. `propertyNames` in two of Claude Code's tools) left out,
with one warning in the log per set of keywords. Every API's tools pass here (spec.parse_tools):
an agent sends the same tools on every request, and a 400 for a keyword the model can do without
would stop it. A schema that is invalid otherwise is left for the caller's check to name."""
from __future__ import annotations

import json
import logging
import re
from functools import lru_cache

log = logging.getLogger("specdecode.serve")
UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
MAX_STRIPS = 8                    # rounds of leaving out unimplemented keywords from one schema
_warned: set[tuple[str, ...]] = set()      # the sets of keywords already logged


def supported(schema: dict) -> dict:
    """`schema` without the keywords the grammar engine does not implement."""
    text, dropped = _supported(json.dumps(schema, sort_keys=True))
    if dropped and dropped not in _warned:
        _warned.add(dropped)
        log.warning("tools: the JSON-schema keywords %s are left out of tool schemas (the structured-output "
                    "engine does not implement them)", ", ".join(dropped))
    return json.loads(text) if dropped else schema


@lru_cache(maxsize=512)                  # an agent sends the same tools on every request
def _supported(text: str) -> tuple[str, tuple[str, ...]]:
    from ...params import ParamError
    from ...structured import Structured, check_grammar
    schema, dropped = json.loads(text), set()
    for _ in range(MAX_STRIPS):
        try:
            check_grammar(Structured("json_schema", schema))
            break
        except ParamError as exc:
            found = UNIMPLEMENTED.search(str(exc))
            keys = set(json.loads(found.group(1))) if found else set()
            if not keys or keys <= dropped:
                break
            dropped |= keys
            schema = _without(schema, keys)
    return json.dumps(schema), tuple(sorted(dropped))


def _without(node, keys: set[str], names: bool = False):
    """A copy of a schema without `keys` (`names`: `node` maps property names, which are kept)."""
    if isinstance(node, list):
        return [_without(item, keys) for item in node]
    if not isinstance(node, dict):
        return node
    return {k: _without(v, keys, names=not names and k in ("properties", "patternProperties", "$defs",
                                                                      "definitions"))
            for k, v in node.items() if names or k not in keys}


def closed(schema):
    """A copy of `schema` whose object schemas with `properties` and no `additionalProperties` /
    `patternProperties` get `additionalProperties: false`."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) if key != "properties" and key != "enum" and key != "const" else value
           for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {name: closed(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and "patternProperties" not in schema:
            out["additionalProperties"] = False
    return out
