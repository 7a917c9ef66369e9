"""Cut the Responses API out of OpenAI's published OpenAPI description (github.com/openai/openai-openapi,
openapi.json or openapi.yaml, MIT): the operations specdecode's server answers (POST /responses, GET and
DELETE /responses/{response_id}, POST /responses/{response_id}/cancel) and every component they refer to,
followed to the end, as one OpenAPI document (tests/serve/data/openai_responses.openapi.json, which
tests/serve/test_responses_fuzz.py fuzzes the server with). Descriptions and examples are left out.

    python scripts/setup/cut_openapi_responses.py path/to/openapi.json [its commit]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OPERATIONS = {"/responses": ("post",), "/responses/{response_id}": ("get", "delete"),
              "/responses/{response_id}/cancel": ("post",)}
DROPPED = ("description", "example", "examples", "x-oaiMeta", "x-oaiTypeLabel", "x-oaiExpandable", "title",
           "summary")
OUT = Path(__file__).resolve().parents[2] / "tests" / "serve" / "data" / "openai_responses.openapi.json"


def refs(node) -> set[str]:
    """The `#/components/...` references in a part of the document."""
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def bare(node, properties: bool = False):
    """`node` without documentation keys (`properties`: a map of property names, all kept)."""
    if isinstance(node, dict):
        return {k: bare(v, k == "properties" and not properties) for k, v in node.items()
                if properties or k not in DROPPED}
    if isinstance(node, list):
        return [bare(v) for v in node]
    return node


def cut(spec: dict) -> dict:
    paths = {path: {method: spec["paths"][path][method] for method in methods}
             for path, methods in OPERATIONS.items()}
    components: dict[str, dict] = {}
    todo = sorted(refs(paths))
    while todo:
        ref = todo.pop()
        _, _, kind, name = ref.split("/")
        if name in components.get(kind, {}):
            continue
        node = spec["components"][kind][name]
        components.setdefault(kind, {})[name] = node
        todo += sorted(refs(node))
    info = {"title": "OpenAI Responses API (cut)", "version": spec["info"]["version"]}
    return {"openapi": spec["openapi"], "info": info,
            "servers": spec.get("servers", []), "paths": bare(paths),
            "components": {kind: {name: bare(node) for name, node in sorted(found.items())}
                           for kind, found in sorted(components.items())}}


def main() -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="OpenAI's openapi.json (or openapi.yaml)")
    parser.add_argument("commit", nargs="?", default="", help="the openai-openapi commit it comes from")
    args = parser.parse_args()
    source = args.source
    text = source.read_text()
    if source.suffix == ".json":
        spec = json.loads(text)
    else:
        import yaml
        spec = yaml.safe_load(text)
    doc = cut(spec)
    doc["info"]["x-source"] = (f"github.com/openai/openai-openapi {args.commit}".strip() +
                               f" {source.name}; MIT License, see LICENSE-openai-openapi; cut by "
                               f"scripts/setup/cut_openapi_responses.py")
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{OUT}: {sum(len(v) for v in doc['components'].values())} components")
    return 0


if __name__ == "__main__":
    sys.exit(main())
