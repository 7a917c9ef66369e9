"""OpenAI's Responses API request as the chat request `protocol.parse` takes (`chat_body`).

`input` (a string or items), `instructions`, `tools`, `tool_choice` and `text.format` become chat
messages, chat tools and `response_format`; the sampling and speculation fields pass through
under their chat names. Every malformed field is an `ApiError` naming it in the Responses
request's own terms (`input[2].content[0]`, `tools[3]`, `text.format`). What the server cannot
run but an agent always sends is skipped, never refused: tools of other types than `function`
(`web_search`, `namespace`, `file_search`, `mcp`, ...; one warning in the log per set of types)
and input items of hosted tools. `reasoning` items are accepted and left out of the prompt (chat
templates drop an earlier turn's thinking); fields the server has no use for (`reasoning`,
`include`, `metadata`, `prompt_cache_key`, `truncation`, `user`, ...) are accepted and ignored.
"""
from __future__ import annotations

import logging
import re

from .content import Parts
from .errors import ApiError

log = logging.getLogger("specdecode.serve")

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
# chat fields a Responses request may carry unchanged: sampling, and this server's own extras
PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "stop", "ignore_eos", "logit_bias", "speculate", "num_speculative_tokens",
          "chat_template_kwargs", "user", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
REFUSED = {"conversation": "the Conversations API is not served: send previous_response_id or the whole input",
           "prompt": "reusable prompts (a prompt id) are not served: send instructions and input"}
KNOWN = {"reasoning.effort": ("none", "minimal", "low", "medium", "high", "xhigh"),
         "reasoning.summary": ("auto", "concise", "detailed"), "truncation": ("auto", "disabled")}
_warned: set[tuple[str, ...]] = set()       # the sets of skipped tool types already logged


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param} {message}", param=param)


PARTS = Parts(TEXT_PARTS, _bad)


def content_text(content, param: str) -> str:
    """A message's content (a string, or a list of text parts) as one string."""
    return PARTS.text(content, param)


def input_items(body: dict) -> list[dict]:
    """`input` as a list of items (a string is one user message)."""
    value = body.get("input")
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad("input", f"must be a string or a list of items, got {value!r:.80}")
    return value


def messages_of(items: list[dict], param: str = "input") -> list[dict]:
    """Chat messages of Responses items: messages, function calls (an assistant turn's tool_calls;
    consecutive calls join the turn before them) and their outputs (tool turns)."""
    out: list[dict] = []
    skipped: list[str] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"must be an item object, got {item!r:.80}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r:.40}")
            out.append({"role": role, "content": content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("name", "call_id", "arguments"):
                if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                    raise _bad(f"{where}.{key}", f"must be a{' non-empty' if key != 'arguments' else ''} string, "
                                                 f"got {item.get(key)!r:.80}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = out[-1].get("tool_calls", []) + [call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise _bad(f"{where}.call_id", f"must be a non-empty string, got {item.get('call_id')!r:.80}")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else content_text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        elif isinstance(kind, str):
            skipped.append(kind)            # hosted tools' calls and outputs, item references, ...
        else:
            raise _bad(f"{where}.type", f"must name the item's type (message, function_call, "
                                        f"function_call_output, reasoning), got {item!r:.80}")
    if skipped:
        log.info("responses: input items of types %s left out of the prompt", ", ".join(sorted(set(skipped))))
    return out


def with_instructions(instructions, messages: list[dict]) -> list[dict]:
    """`instructions` and the leading system / developer messages as one system message (a chat
    template may refuse a second one, or one after the first turn); later developer messages are
    system messages where they stand."""
    lead = [] if instructions is None else [content_text(instructions, "instructions")]
    at = 0
    while at < len(messages) and messages[at]["role"] in ("system", "developer"):
        lead.append(messages[at]["content"])
        at += 1
    rest = [dict(m, role="system") if m["role"] == "developer" else m for m in messages[at:]]
    lead = [text for text in lead if text]
    return ([{"role": "system", "content": "\n\n".join(lead)}] if lead else []) + rest


def chat_tools(body: dict) -> tuple[list[dict], list[int]]:
    """(the function tools in chat's shape, each one's index in `tools`); other types skipped."""
    tools = body.get("tools")
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise _bad("tools", f"must be a list of tools, got {tools!r:.80}")
    out, where, skipped = [], [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise _bad(f"tools[{i}]", f"must be a tool object with a type, got {tool!r:.80}")
        if tool["type"] != "function":
            skipped.append(tool["type"])
            continue
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool   # chat's shape too
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad(f"tools[{i}].name", f"must be a non-empty string, got {function.get('name')!r:.80}")
        out.append({"type": "function", "function": {key: function[key] for key in
                                                       ("name", "description", "parameters", "strict")
                                                       if function.get(key) is not None}})
        where.append(i)
    kinds = tuple(sorted(set(skipped)))
    if kinds and kinds not in _warned:
        _warned.add(kinds)
        log.warning("responses: tools of types %s are skipped (only function tools run on this server)",
                    ", ".join(kinds))
    return out, where


def chat_tool_choice(choice, names: list[str]):
    """Responses' tool_choice in chat's terms; a choice of a hosted tool is "auto"."""
    if choice is None or choice in ("auto", "required", "none"):
        return choice if names or choice in (None, "none") else None
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise _bad("tool_choice", f"must be auto, required, none or an object with a type, got {choice!r:.80}")
    if choice.get("type") == "function":
        name = choice.get("name", (choice.get("function") or {}).get("name"))
        if name not in names:
            raise _bad("tool_choice", f"names {name!r:.40}, which is no function of tools "
                                      f"({', '.join(names) or 'none given'})")
        return {"type": "function", "function": {"name": name}}
    if choice.get("type") == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise _bad("tool_choice.mode", f"must be auto or required, got {mode!r:.40}")
        return mode if names else None
    return "auto" if names else None


def allowed(choice, tools: list[dict], where: list[int]) -> tuple[list[dict], list[int]]:
    """`tool_choice: {"type": "allowed_tools", "tools": [...]}` keeps the function tools it names."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return tools, where
    listed = choice.get("tools")
    if not isinstance(listed, list):
        raise _bad("tool_choice.tools", f"must be a list of tools, got {listed!r:.80}")
    names = {t.get("name") for t in listed if isinstance(t, dict) and t.get("type") == "function"}
    kept = [(t, i) for t, i in zip(tools, where) if t["function"]["name"] in names]
    return [t for t, _ in kept], [i for _, i in kept]


def response_format(body: dict) -> dict | None:
    """`text.format` as chat's response_format (None: plain text)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", f"must be an object {{'format': {{...}}}}, got {text!r:.80}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema", f"must be a JSON schema object, got {fmt.get('schema')!r:.80}")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "answer", "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise _bad("text.format", f"must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got {fmt!r:.80}")


def check_echoed(body: dict) -> None:
    """The fields the response echoes, unused otherwise: of the API's types (a value the API may
    add later, e.g. a new reasoning effort, is accepted: `echoed` leaves it out)."""
    for name, kind, what in (("metadata", dict, "an object of strings"), ("reasoning", dict, "an object"),
                             ("user", str, "a string"), ("prompt_cache_key", str, "a string"),
                             ("previous_response_id", str, "a string"), ("truncation", str, "a string")):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise _bad(name, f"must be {what}, got {body[name]!r:.80}")
    if body.get("metadata") and not all(isinstance(v, str) for v in body["metadata"].values()):
        raise _bad("metadata", f"values must be strings, got {body['metadata']!r:.80}")
    for key in ("effort", "summary"):
        value = (body.get("reasoning") or {}).get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(f"reasoning.{key}", f"must be a string, got {value!r:.40}")


def echoed(body: dict, name: str):
    """A setting as the response echoes it: the value sent when the API knows it, else None."""
    outer, _, inner = name.partition(".")
    value = (body.get(outer) or {}).get(inner) if inner else body.get(outer)
    return value if value in KNOWN[name] else None


def chat_body(body: dict, history: list[dict]) -> tuple[dict, list[dict], list[int]]:
    """(the chat request, this response's conversation as Responses items: `history` then the
    input, the function tools' indices in `tools`). `history`: a previous response's items and
    output (previous_response_id), whose instructions do not carry over (as OpenAI's)."""
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise _bad(name, why)
    items = history + input_items(body)
    messages = with_instructions(body.get("instructions"), messages_of(items))
    if not any(m["role"] != "system" for m in messages):
        raise _bad("input", "must hold at least one message (a string, or items with a user message)")
    tools, where = chat_tools(body)
    tools, where = allowed(body.get("tool_choice"), tools, where)
    chat: dict = {"model": body.get("model"), "messages": messages, "stream": body.get("stream")}
    chat.update({name: body[name] for name in PASSED if body.get(name) is not None})
    choice = chat_tool_choice(body.get("tool_choice"), [t["function"]["name"] for t in tools])
    if tools:
        chat["tools"] = tools
        chat["parallel_tool_calls"] = body.get("parallel_tool_calls")
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = response_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    effort = body.get("reasoning").get("effort") if isinstance(body.get("reasoning"), dict) else None
    # effort "none": no thinking, where the chat template reads enable_thinking (Qwen3, Gemma 4)
    if effort == "none" and isinstance(chat.get("chat_template_kwargs", {}), dict):
        chat["chat_template_kwargs"] = {"enable_thinking": False, **(chat.get("chat_template_kwargs") or {})}
    return chat, items, where


def param_of(exc: ApiError, where: list[int]) -> ApiError:
    """A chat parse's error in the Responses request's terms: its fields and its tools' indices."""
    names = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens"}
    message = exc.message
    for chat, ours in names.items():
        message = message.replace(chat, ours)
    message = re.sub(r"tools\[(\d+)\]", lambda m: f"tools[{where[int(m[1])]}]" if int(m[1]) < len(where)
                     else m[0], message)
    param = exc.param.split("[")[0] if exc.param else None
    return ApiError(exc.status, message, names.get(param, exc.param), exc.code)
