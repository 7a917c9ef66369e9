"""Anthropic's Messages API request, translated into the chat completions body `protocol.parse` takes.

One pipeline serves both APIs: a Messages request becomes the OpenAI chat body it means (system
blocks joined into a system message, `tool_use` blocks as an assistant turn's `tool_calls`,
`tool_result` blocks as `tool` messages, Anthropic's tools as function tools), and the template,
tools, sampling and speculation fields are then parsed and checked as on /v1/chat/completions.
What a text model cannot take (image and document blocks) is a 400 naming the block; server tools
(`web_search_*`, `bash_*`, `text_editor_*`, ... : tools with a `type` other than "custom") are skipped
with one warning per type in the server log, since an agent sends them on every request and a 400
would stop it. Unknown top-level fields (`metadata`, `context_management`, `output_config`, ...)
are ignored, as the API's own clients send fields a server may not know.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

from .content import Parts
from .content import short as _short
from .errors import ApiError

log = logging.getLogger("specdecode.serve")
MAX_STOP_SEQUENCES = 16           # SamplingParams' limit on stop strings
ROLES = ("user", "assistant", "system")
THINKING_TYPES = ("enabled", "adaptive", "disabled")
TOOL_CHOICES = ("auto", "any", "tool", "none")
REFUSED_BLOCKS = ("image", "document")          # need a model that reads them
PASSED_FIELDS = ("model", "stream", "temperature", "top_p", "top_k",
                 # this server's own fields, as on chat completions (structured output: vLLM's names)
                 "speculate", "num_speculative_tokens", "ignore_eos", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar")
_warned_tool_types: set[str] = set()           # server tool types already warned about (one line each)


@dataclass
class MessagesRequest:
    chat: dict                      # the chat completions body: what protocol.parse takes
    max_tokens: int | None          # as asked (None: count_tokens); clamped later to the room left
    stop_sequences: list[str] = field(default_factory=list)
    skipped_tools: list[str] = field(default_factory=list)    # server tool types left out
    tool_index: list[int] = field(default_factory=list)       # each function tool's index in `tools`
    thinking_budget: int | None = None                        # thinking.budget_tokens (type enabled)

    def param(self, message: str) -> str:
        """An error from the chat checks of the tools (`tools[j].function.parameters`, j counting
        function tools) in this API's terms (`tools.i.input_schema`)."""
        where = self.tool_index
        return re.sub(r"tools\[(\d+)\]\.function\.parameters",
                      lambda m: f"tools.{where[int(m.group(1))]}.input_schema" if int(m.group(1)) < len(where)
                      else m.group(0), message)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


TEXT_BLOCKS = Parts(("text",), _bad, sep="\n", index=".{}")        # cache_control, citations: ignored


def _text_of(blocks, param: str, what: str) -> str:
    """A string, or the text of a list of text blocks."""
    return TEXT_BLOCKS.text(blocks, param, what)


def _refused(param: str, kind: str) -> ApiError:
    return _bad(param, f"{kind} blocks need a model that reads {kind}s; this server serves a text model "
                       f"(send the content as text)")


def _user_turns(content, i: int) -> list[dict]:
    """A user message's blocks in order: text runs as user messages, each `tool_result` as a `tool`
    message (an error result's text starts with "Error: ", as the chat API has no flag for it)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(_blocks(content, i)):
        kind, param = block["type"], f"messages.{i}.content.{j}"
        if kind == "text":
            texts.append(_string(block, "text", param))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            result = block.get("content", "")
            text = _text_of(result, f"{param}.content", "a tool_result's content") if result is not None else ""
            is_error = block.get("is_error")
            if is_error is not None and not isinstance(is_error, bool):
                raise _bad(f"{param}.is_error", f"must be true or false, got {_short(is_error)}")
            out.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", param),
                        "content": "Error: " + text if is_error else text})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _bad(param, f"a user message takes text and tool_result blocks, got type {kind!r}")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(content, i: int) -> dict:
    """An earlier assistant turn: its text, its `tool_use` blocks as tool_calls (input as the
    arguments' JSON), its thinking blocks' text as `reasoning_content` (which the chat path hands to a
    template that writes earlier reasoning); redacted thinking is left out."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(_blocks(content, i)):
        kind, param = block["type"], f"messages.{i}.content.{j}"
        if kind == "text":
            texts.append(_string(block, "text", param))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", param))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise _bad(f"{param}.input", f"must be an object, got {_short(arguments)}")
            calls.append({"id": _string(block, "id", param), "type": "function",
                          "function": {"name": _string(block, "name", param, empty=False),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind != "redacted_thinking":
            raise _bad(param, f"an assistant message takes text, tool_use and thinking blocks, got type {kind!r}")
    turn: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if thoughts:
        turn["reasoning_content"] = "\n".join(thoughts)
    return turn


def _blocks(content, i: int) -> list[dict]:
    if not isinstance(content, list):
        raise _bad(f"messages.{i}.content", f"must be a string or a list of content blocks, got {_short(content)}")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"messages.{i}.content.{j}", f"must be a content block {{'type': ...}}, got {_short(block)}")
        if block["type"] in REFUSED_BLOCKS:
            raise _refused(f"messages.{i}.content.{j}", block["type"])
    return content


def _string(block: dict, key: str, param: str, empty: bool = True) -> str:
    value = block.get(key)
    if not isinstance(value, str) or (not empty and not value):
        raise _bad(f"{param}.{key}", f"must be a{'' if empty else ' non-empty'} string, got {_short(value)}")
    return value


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects")
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system", "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"messages.{i}", f"must be an object with role {', '.join(ROLES)}, got {_short(m)}")
        if "content" not in m:
            raise _bad(f"messages.{i}.content", "is required")
        if m["role"] == "system":          # Claude Code sends some in the conversation: a system turn there
            out.append({"role": "system", "content": _text_of(m["content"], f"messages.{i}.content", "content")})
        else:
            out += _user_turns(m["content"], i) if m["role"] == "user" else [_assistant_turn(m["content"], i)]
    return out


def _tools(body: dict, chat: dict) -> tuple[list[str], list[int]]:
    """Anthropic's tools as function tools in `chat` (with tool_choice and parallel_tool_calls);
    returns (the server tool types skipped, each function tool's index in `tools`)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _bad("tools", f"must be a list of tools, got {_short(tools)}")
    functions, skipped, where = [], [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools.{i}", f"must be an object, got {_short(tool)}")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            if not isinstance(kind, str):
                raise _bad(f"tools.{i}.type", f"must be a string, got {_short(kind)}")
            skipped.append(kind)
            continue
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools.{i}.name", f"must be a non-empty string, got {_short(name)}")
        if not isinstance(schema, dict):
            raise _bad(f"tools.{i}.input_schema", f"must be a JSON schema object, got {_short(schema)}")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"tools.{i}.description", f"must be a string, got {_short(description)}")
        function = {"name": name, "parameters": schema}
        if description:
            function["description"] = description
        functions.append({"type": "function", "function": function})
        where.append(i)
    new = sorted(set(skipped) - _warned_tool_types)
    if new:
        _warned_tool_types.update(new)
        log.warning("Messages API: skipping server tools this server cannot run (types %s)", ", ".join(new))
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in TOOL_CHOICES:
            raise _bad("tool_choice", f"must be {{'type': one of {', '.join(TOOL_CHOICES)}}}, got {_short(choice)}")
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None and not isinstance(parallel, bool):
            raise _bad("tool_choice.disable_parallel_tool_use", f"must be true or false, got {_short(parallel)}")
        if functions and parallel:
            chat["parallel_tool_calls"] = False
        kind = choice["type"]
        if kind == "tool":
            name = choice.get("name")
            if not isinstance(name, str) or name not in [f["function"]["name"] for f in functions]:
                raise _bad("tool_choice.name", f"must name one of the tools, got {_short(name)}")
            chat["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif functions:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if functions:
        chat["tools"] = functions
    return skipped, where


def _thinking(body: dict, chat: dict) -> int | None:
    """`thinking`: enabled / adaptive turn the template's thinking on, disabled off (a model that does
    not think ignores it); absent leaves the model's default. Returns enabled's budget_tokens, the most
    tokens the reasoning may take (generation.with_budget)."""
    thinking = body.get("thinking")
    if thinking is None:
        return None
    if not isinstance(thinking, dict) or thinking.get("type") not in THINKING_TYPES:
        raise _bad("thinking", f"must be {{'type': one of {', '.join(THINKING_TYPES)}}}, got {_short(thinking)}")
    budget = thinking.get("budget_tokens")
    if thinking["type"] == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise _bad("thinking.budget_tokens", f"must be an integer >= 1 with type enabled, got {_short(budget)}")
    chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    return budget if thinking["type"] == "enabled" else None


def translate(body, count_only: bool = False) -> MessagesRequest:
    """The Messages request `body` as a chat completions body (ApiError naming the field on a bad one).
    `count_only`: /v1/messages/count_tokens (no max_tokens, no sampling)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    chat: dict = {"messages": _messages(body)}
    max_tokens = None
    if not count_only:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise _bad("max_tokens", "is required (the most tokens to generate; more than the context leaves "
                                     "is clamped to what it leaves)")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad("max_tokens", f"must be an integer >= 1, got {_short(max_tokens)}")
    stops = body.get("stop_sequences")
    if stops is not None and not count_only:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop_sequences", f"must be a list of non-empty strings, got {_short(stops)}")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise _bad("stop_sequences", f"takes at most {MAX_STOP_SEQUENCES} strings, got {len(stops)}")
        if stops:
            chat["stop"] = list(stops)
    for name in PASSED_FIELDS if not count_only else ("model",):
        if body.get(name) is not None:
            chat[name] = body[name]
    skipped, where = _tools(body, chat)
    budget = _thinking(body, chat)
    return MessagesRequest(chat, max_tokens, list(stops or []) if not count_only else [], skipped, where, budget)
