"""Tool calls on /v1/chat/completions: OpenAI's `tools` / `tool_choice`, in the Hermes format most
open chat models are trained on (Qwen2.5, Hermes, SmolLM's tool variants):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The tools reach the model through its chat template when the template takes `tools` (as
transformers renders it), else as a system instruction in that format. With `tool_choice`
"required" or a named function, the output is constrained (structured output, llguidance) to one
such block whose arguments follow the function's JSON schema; with "auto" the model decides and
the answer is parsed. Parsed calls become OpenAI `tool_calls` with finish_reason "tool_calls".
The forced call is compact JSON (no line breaks or indentation), and an object of the arguments'
schema that does not say `additionalProperties` admits only its listed properties (as xgrammar's
strict mode and OpenAI's strict function calling): a small model otherwise copies the schema itself
into the arguments and never closes the call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..params import ParamError
from ..structured import JSON_STYLE, Structured, check_grammar

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    tools: list[dict]            # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str                  # "auto" | "required" | "none" | a function name

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    def system_prompt(self) -> str:
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions())
        return ("You may call one or more functions to answer. The functions are:\n<tools>\n" + listing +
                "\n</tools>\nTo call one, answer with\n<tool_call>\n{\"name\": <function name>, \"arguments\": "
                "<arguments as a JSON object>}\n</tool_call>")

    def structured(self) -> Structured | None:
        """The constraint of "required" / a named function: one call block, arguments per schema."""
        if self.choice in ("auto", "none"):
            return None
        chosen = [f for f in self.functions() if self.choice == "required" or f["name"] == self.choice]
        schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                     "arguments": closed(f.get("parameters") or {"type": "object"})},
                    "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema["x-guidance"] = dict(JSON_STYLE)          # llguidance's options: compact, one separator style
        lark = ('start: "<tool_call>\\n" call "\\n</tool_call>"\n'
                f"call: %json {json.dumps(schema)}\n")
        return Structured("grammar", lark)


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


def parse_tools(body: dict) -> ToolSpec | None:
    """The request's tools, validated (ParamError naming the field), or None."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ParamError("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise ParamError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ParamError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise ParamError(f"tools[{i}].function.parameters must be a JSON schema object")
        if f.get("parameters"):
            try:
                check_grammar(Structured("json_schema", f["parameters"]))
            except ParamError as exc:
                raise ParamError(f"tools[{i}].function.parameters is not a valid JSON schema: "
                                 f"{str(exc).removeprefix('invalid json_schema: ')}") from None
        names.append(f["name"])
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ParamError(f"tool_choice names no function of tools ({', '.join(names)}): {choice!r:.80}")
        choice = name
    elif choice not in ("auto", "required", "none"):
        raise ParamError(f"tool_choice must be auto, required, none or {{'type': 'function', ...}}, got {choice!r:.80}")
    return ToolSpec(tools, choice)


def extract_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside tool-call blocks or None, OpenAI tool_calls) of a finished answer."""
    calls = []
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    if not calls:
        return text, []
    rest = CALL.sub("", text).strip()
    return rest or None, calls
