"""Trim OpenAI's published OpenAPI description (github.com/openai/openai-openapi, openapi.yaml, MIT)
to the response schemas specdecode's server answers with, as one JSON Schema document
(tests/serve/data/openai_responses.schema.json, which tests/serve/test_openapi_schema.py validates
responses against).

    python scripts/setup/trim_openapi.py path/to/openapi.yaml [its commit]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOTS = ("CreateCompletionResponse", "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "ListModelsResponse", "Model", "ErrorResponse")
OUT = Path(__file__).resolve().parents[2] / "tests" / "serve" / "data" / "openai_responses.schema.json"


def refs(node) -> set[str]:
    """The component schema names a schema refers to."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[1]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def rewrite(node):
    """#/components/schemas/X -> #/$defs/X; OpenAPI 3.0's `nullable: true` (which the file still
    uses in places) -> anyOf [the schema, null]; documentation-only keys dropped."""
    if isinstance(node, dict):
        out = {k: ("#/$defs/" + v.rsplit("/", 1)[1] if k == "$ref" else rewrite(v)) for k, v in node.items()
               if k not in ("description", "example", "examples", "x-oaiMeta", "x-oaiTypeLabel", "deprecated",
                            "nullable")}
        return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out
    if isinstance(node, list):
        return [rewrite(v) for v in node]
    return node


def main() -> int:
    schemas = yaml.safe_load(Path(sys.argv[1]).read_text())["components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += sorted(refs(schemas[name]) - keep)
    doc = {"$schema": "https://json-schema.org/draft/2020-12/schema",
           "$comment": f"Trimmed from OpenAI's openapi.yaml (github.com/openai/openai-openapi "
                       f"{sys.argv[2] if len(sys.argv) > 2 else ''}; MIT License, see LICENSE-openai-openapi) by "
                       f"scripts/setup/trim_openapi.py",
           "$defs": {name: rewrite(schemas[name]) for name in sorted(keep)}}
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{OUT}: {len(keep)} schemas")
    return 0


if __name__ == "__main__":
    sys.exit(main())
