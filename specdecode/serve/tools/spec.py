"""A request's `tools` / `tool_choice`: validation, the prompt, and the grammar of a forced call.

The tools reach the model through its chat template when the template writes them (as
transformers renders it), else as a system instruction showing the model's own call format
(formats.py). With `tool_choice` "required" or a named function, the output is constrained
(structured output, llguidance) to one call in that format whose arguments follow the function's
JSON schema; with "auto" the model decides and the answer is parsed (parser.py). Parsed calls
become OpenAI `tool_calls` with finish_reason "tool_calls".
The forced call is compact JSON (no line breaks or indentation), and an object of the arguments'
schema that does not say `additionalProperties` admits only its listed properties (as xgrammar's
strict mode and OpenAI's strict function calling): a small model otherwise copies the schema itself
into the arguments and never closes the call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ...params import ParamError
from ...structured import JSON_STYLE, Structured, check_grammar
from .formats import HERMES, ToolFormat, renders_tool_turns, takes_tools
from .markup_grammar import call_grammar
from .schema import closed, supported

# a template that reads tool definitions from the system message's own `tools` field (Phi-4-mini)
MESSAGE_TOOLS = re.compile(r"""message\s*(\[\s*['"]tools['"]\s*\]|\.tools\b)""")


@dataclass(frozen=True)
class ToolSpec:
    tools: list[dict]            # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str                  # "auto" | "required" | "none" | a function name
    fmt: ToolFormat = field(default=HERMES)
    parallel: bool = True        # parallel_tool_calls: false keeps an answer's first call only

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    def system_prompt(self) -> str:
        return self.fmt.instruction(self.functions())

    def structured(self) -> Structured | None:
        """The constraint of "required" / a named function: one call, arguments per schema."""
        if self.choice in ("auto", "none"):
            return None
        key = self.fmt.args_key
        chosen = [f for f in self.functions() if self.choice == "required" or f["name"] == self.choice]
        if self.fmt.markup:                              # Qwen3-Coder's XML, Gemma 4's notation
            return Structured("grammar", call_grammar(self.fmt, chosen))
        schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                     key: closed(f.get("parameters") or {"type": "object"})},
                    "required": ["name", key], "additionalProperties": False} for f in chosen]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema["x-guidance"] = dict(JSON_STYLE)          # llguidance's options: compact, one separator style
        return Structured("grammar", self.fmt.grammar(schema))


def parse_tools(body: dict, fmt: ToolFormat | None = None) -> ToolSpec | None:
    """The request's tools, validated (ParamError naming the field), or None. `fmt`: the model's
    call format (`formats.detect`), read only when the request has tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ParamError("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise ParamError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    names, kept = [], []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ParamError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise ParamError(f"tools[{i}].function.parameters must be a JSON schema object")
        if f.get("parameters"):
            f = dict(f, parameters=supported(f["parameters"]))      # keywords the grammar cannot compile: out
            t = dict(t, function=f)
            try:
                check_grammar(Structured("json_schema", f["parameters"]))
            except ParamError as exc:
                raise ParamError(f"tools[{i}].function.parameters is not a valid JSON schema: "
                                 f"{str(exc).removeprefix('invalid json_schema: ')}") from None
        names.append(f["name"])
        kept.append(t)
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ParamError(f"tool_choice names no function of tools ({', '.join(names)}): {choice!r:.80}")
        choice = name
    elif choice not in ("auto", "required", "none"):
        raise ParamError(f"tool_choice must be auto, required, none or {{'type': 'function', ...}}, got {choice!r:.80}")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ParamError(f"parallel_tool_calls must be true or false, got {parallel!r:.80}")
    return ToolSpec(kept, choice, fmt if fmt is not None else HERMES, parallel is not False)


def with_tools(messages: list[dict], tools: ToolSpec | None, tokenizer,
               tool_format=lambda: HERMES) -> tuple[list[dict], list[dict] | None]:
    """(the messages, the `tools` for the template): the template's own way when it writes the
    tools it is given; a template reading them from the system message's `tools` field (Phi-4-mini)
    gets them there; else the format's instruction as (or after) the system message. Earlier
    calls' arguments sent as JSON strings (as OpenAI's clients send them) reach the template as
    objects, as transformers' templates expect (they write them with `tojson`); earlier calls and
    tool results that the template would drop are written into the turns' text (`as_text`).
    `tool_format()`: the model's call format, asked for only when a turn needs it."""
    messages = [_arguments_as_objects(m) for m in messages]
    if "tool_responses" in (tokenizer.chat_template or "") and any(m["role"] == "tool" for m in messages):
        messages = in_calling_turn(messages)
    if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = as_text(messages, tools.fmt if tools is not None else tool_format(), tokenizer)
    if tools is None or not tools.active:
        return messages, None
    if takes_tools(tokenizer):
        return messages, tools.tools
    template = tokenizer.chat_template or ""
    if MESSAGE_TOOLS.search(template):
        listing = json.dumps(tools.functions(), ensure_ascii=False)
        if messages and messages[0]["role"] == "system":
            return [dict(messages[0], tools=listing)] + messages[1:], None
        return [{"role": "system", "content": "", "tools": listing}] + messages, None
    if messages and messages[0]["role"] == "system":
        return [dict(messages[0], content=messages[0]["content"] + "\n\n" + tools.system_prompt())] + messages[1:], None
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is not None and not takes_system(tokenizer):      # Gemma 2: the instruction opens the user turn
        m = messages[first_user]
        return messages[:first_user] + [dict(m, content=tools.system_prompt() + "\n\n" + m["content"])] + \
            messages[first_user + 1:], None
    return [{"role": "system", "content": tools.system_prompt()}] + messages, None


def in_calling_turn(messages: list[dict]) -> list[dict]:
    """Tool results as the calling turn's `tool_responses` ({"name", "response"}: a JSON object's
    content as the object, else the text), as Gemma 4's templates write them (`<|tool_response>` blocks
    inside the model's turn; its first template writes a `tool` message as a turn of role "tool",
    which the model never saw in training). A result without a calling turn before it is left as it is."""
    out: list[dict] = []
    for m in messages:
        calls = out[-1].get("tool_calls") if out and out[-1]["role"] == "assistant" else None
        if m["role"] != "tool" or not calls:
            out.append(m)
            continue
        name = next((c["function"]["name"] for c in calls if isinstance(c, dict) and isinstance(c.get("function"), dict)
                     and c.get("id") == m.get("tool_call_id")), m.get("name") or "unknown")
        try:
            response = json.loads(m["content"])
        except ValueError:
            response = None
        response = response if isinstance(response, dict) else m["content"]
        out[-1] = dict(out[-1], tool_responses=out[-1].get("tool_responses", []) + [{"name": name,
                                                                                     "response": response}])
    return out


def takes_system(tokenizer) -> bool:
    """Does the chat template accept a system message (Gemma 2's raises)?"""
    try:
        tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    except Exception:  # noqa: BLE001 -- jinja's TemplateError, or whatever the template raises
        return False
    return True


def _arguments_as_objects(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                call = dict(call, function=dict(function, arguments=json.loads(function["arguments"])))
            except json.JSONDecodeError:
                pass
        out.append(call)
    return dict(message, tool_calls=out)


def as_text(messages: list[dict], fmt: ToolFormat, tokenizer) -> list[dict]:
    """Earlier tool turns that the chat template does not write, written into the turns' text: an
    assistant turn's calls in the model's own format after its content, and tool results (for a
    template without the role) as a user turn of `<tool_response>` blocks, as Hermes' and Qwen's
    templates write them. A template like SmolLM2's writes an empty assistant turn for a call,
    so the model would never see the call it had made."""
    calls_written, results_written = renders_tool_turns(tokenizer)
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls") and not calls_written:
            calls = [(c["function"]["name"], c["function"].get("arguments", {})) for c in m["tool_calls"]]
            text = fmt.write(calls)
            m = {"role": "assistant", "content": m["content"] + "\n" + text if m["content"] else text}
        elif m["role"] == "tool" and not results_written:
            block = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1]["content"].endswith("</tool_response>"):
                out[-1] = dict(out[-1], content=out[-1]["content"] + "\n" + block)    # results of one turn
                continue
            m = {"role": "user", "content": block}
        out.append(m)
    return out
