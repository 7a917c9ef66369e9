"""Each model family's tool-call format, read from the model's chat template and vocabulary.

* `hermes` (Hermes 2/3, Qwen2.5, Qwen3, SmolLM3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  chosen when the template writes `<tool_call>`; also the fallback.
* `llama3` (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}` (`<|python_tag|>` before it is accepted); chosen
  when the template writes `<|python_tag|>`, or `"parameters"` with `<|start_header_id|>`.
* `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`; chosen when `[TOOL_CALLS]` is in the template
  or the vocabulary.
* `phi4` (Phi-4-mini): `<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>`; chosen when the
  vocabulary has `<|tool_call|>` and `<|/tool_call|>`.
* `qwen3_coder` (Qwen3-Coder, Qwen3.5) and `gemma4` (Gemma 4): arguments in the family's own notation, not
  JSON (markup.py, which reads and constrains them).

A marker the vocabulary holds as one token (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`) is that
token: the grammar of a forced call names it by id (`<[id]>` in llguidance's Lark) when llguidance
treats it as a special token, since a special token does not match its text spelled out (with a
quoted `"<tool_call>"` the mask allows the token while the matcher refuses to consume it, and a forced
call repeats `<tool_call>` until max_tokens); and the decoder keeps it in the text the parser reads
(a special token is otherwise skipped when decoding). The whitespace between a marker and the JSON,
and the arguments' key, are read from the template's own rendering of a call when it renders one.
Families whose templates define no tool format (Phi-3, Gemma 2/3) get the Hermes format through a
system instruction.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
import weakref
from dataclasses import dataclass, field, replace

from . import notation
from .notation import GEMMA, MARKUP, QUOTE, XML  # noqa: F401  (XML: the tests name the family)

SENTINEL = "sentinel_fn"
# an earlier turn's call to SENTINEL, which the probes below render to see what a template writes
PROBE_CALL = {"id": "abcdefghi", "type": "function", "function": {"name": SENTINEL, "arguments": {"x": 1}}}


@dataclass(frozen=True)
class Marker:
    text: str
    token: int | None = None         # the vocabulary's one token for the text, if it has one
    special: bool = False            # llguidance treats that token as special: the grammar names its id

    def lark(self) -> str:
        return f"<[{self.token}]>" if self.special and self.token is not None else json.dumps(self.text)


@dataclass(frozen=True)
class ToolFormat:
    name: str                        # hermes | llama3 | mistral | phi4
    start: Marker | None             # written before the call (hermes, phi4) or the list of calls (mistral)
    end: Marker | None = None        # written after it
    args_key: str = "arguments"      # "parameters" for Llama 3
    listed: bool = False             # the calls are one JSON list after `start`
    gap_start: str = ""              # between `start` and the JSON (Qwen: "\n", Mistral v3: " ")
    gap_end: str = ""                # between the JSON and `end`
    also: tuple[Marker, ...] = field(default=())   # other markers that open calls (Llama's <|python_tag|>)
    inner: tuple[Marker, ...] = field(default=())  # tokens inside a call the decoder keeps (Gemma 4's <|"|>)

    def markers(self) -> list[Marker]:
        return [m for m in (self.start, self.end, *self.also) if m is not None]

    @property
    def markup(self) -> bool:
        """Are the arguments written in the family's own notation, not JSON (markup.py)?"""
        return self.name in MARKUP

    def kept_tokens(self) -> dict[int, str]:
        """Marker tokens the decoder keeps as their text (special tokens are skipped otherwise)."""
        return {m.token: m.text for m in self.markers() + list(self.inner) if m.token is not None}

    def grammar(self, call_schema: dict) -> str:        # (the JSON formats'; markup.call_grammar the others')
        """Lark for one call whose JSON follows `call_schema`, in this format's exact tokens."""
        parts = []
        if self.start is not None:
            parts.append(self.start.lark())
        if self.gap_start:
            parts.append(json.dumps(self.gap_start))
        parts += ['"["', "call", '"]"'] if self.listed else ["call"]
        if self.end is not None:
            if self.gap_end:
                parts.append(json.dumps(self.gap_end))
            parts.append(self.end.lark())
        return f"start: {' '.join(parts)}\ncall: %json {json.dumps(call_schema)}\n"

    def _marked(self, objects: list[str]) -> str:
        """Call objects (JSON text) between this format's markers: one list, or one call each."""
        start = (self.start.text if self.start else "") + self.gap_start
        end = self.gap_end + self.end.text if self.end else ""
        if self.listed:
            return start + "[" + ", ".join(objects) + "]" + end
        return "\n".join(start + text + end for text in objects)

    def example(self) -> str:
        """A call in this format, with placeholders (the system instruction shows it)."""
        if self.markup:
            return notation.example(self)
        return self._marked(['{"name": <function name>, "' + self.args_key + '": <arguments as a JSON object>}'])

    def write(self, calls: list[tuple[str, object]]) -> str:
        """Calls (name, arguments) as the model writes them: an earlier turn's calls, for a template
        that does not render `tool_calls` itself."""
        if self.markup:
            return notation.write(self, calls)
        return self._marked([json.dumps({"name": name, self.args_key: args}, ensure_ascii=False)
                             for name, args in calls])

    def instruction(self, functions: list[dict]) -> str:
        """The system prompt that brings the tools to a model whose template does not take them."""
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
        return ("You may call one or more functions to answer. The functions are:\n<tools>\n" + listing +
                "\n</tools>\nTo call one, answer with\n" + self.example())

    def call_id(self) -> str:
        """A new tool call id: Mistral's templates want 9 letters and digits, others OpenAI's call_..."""
        if self.name == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return "call_" + uuid.uuid4().hex[:24]


HERMES = ToolFormat("hermes", Marker("<tool_call>"), Marker("</tool_call>"), gap_start="\n", gap_end="\n")


def single_token(tokenizer, text: str) -> int | None:
    """The id of the one token `text` encodes to, or None."""
    token = tokenizer.token_id(text)
    return token if token is not None and tokenizer.encode(text, add_special=False) == [token] else None


def detect(tokenizer, is_special=lambda token: False) -> ToolFormat:
    """The tool-call format of a model (its `specdecode.tokenizer.Tokenizer`); `is_special(id)`:
    does the grammar engine treat that token as special (structured.GrammarTokenizer)."""
    template = tokenizer.chat_template or ""

    def marker(text: str) -> Marker:
        token = single_token(tokenizer, text)
        return Marker(text, token, token is not None and bool(is_special(token)))

    has = lambda text: single_token(tokenizer, text) is not None        # noqa: E731
    if "<function=" in template and "<parameter=" in template:       # Qwen3-Coder, Qwen3.5: XML (markup.py)
        return ToolFormat(XML, marker("<tool_call>"), marker("</tool_call>"), gap_start="\n", gap_end="\n",
                          also=(Marker("<function="),))
    if "<|tool_call>" in template or (has("<|tool_call>") and has("<tool_call|>")):    # Gemma 4 (markup.py)
        return ToolFormat(GEMMA, marker("<|tool_call>"), marker("<tool_call|>"), inner=(marker(QUOTE),))
    if "[TOOL_CALLS]" in template or has("[TOOL_CALLS]"):
        fmt = ToolFormat("mistral", marker("[TOOL_CALLS]"), listed=True, gap_start=" ")
    elif "<tool_call>" in template:
        fmt = replace(HERMES, start=marker("<tool_call>"), end=marker("</tool_call>"))
    elif "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        fmt = ToolFormat("llama3", None, args_key="parameters", also=(marker("<|python_tag|>"),))
    elif has("<|tool_call|>") and has("<|/tool_call|>"):
        fmt = ToolFormat("phi4", marker("<|tool_call|>"), marker("<|/tool_call|>"), listed=True)
    else:
        fmt = replace(HERMES, start=marker("<tool_call>"), end=marker("</tool_call>"))
    return learn(tokenizer, fmt)


_TAKES_TOOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def takes_tools(tokenizer) -> bool:
    """Does the chat template write the `tools` it is given (not only mention the word)?"""
    if tokenizer not in _TAKES_TOOLS:
        _TAKES_TOOLS[tokenizer] = _renders_tools(tokenizer)
    return _TAKES_TOOLS[tokenizer]


def _renders_tools(tokenizer) -> bool:
    if not tokenizer.chat_template or "tools" not in tokenizer.chat_template:
        return False
    tool = {"type": "function", "function": {"name": SENTINEL, "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool])
    except Exception:  # noqa: BLE001 -- a template that refuses the probe does not take tools
        return False
    return SENTINEL in text


_TOOL_TURNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def renders_tool_turns(tokenizer) -> tuple[bool, bool]:
    """(does the chat template write an assistant turn's `tool_calls`, does it write a `tool`
    message's content): SmolLM2's writes neither call nor arguments, and Gemma's refuses the role."""
    if tokenizer not in _TOOL_TURNS:
        turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
                 {"role": "tool", "content": SENTINEL + "_result", "tool_call_id": "abcdefghi", "name": SENTINEL}]
        found = []
        for messages, mark in ((turns[:2], SENTINEL), (turns, SENTINEL + "_result")):
            try:
                found.append(mark in tokenizer.apply_chat_template(messages, add_generation_prompt=False))
            except Exception:  # noqa: BLE001 -- a template that refuses the turn does not write it
                found.append(False)
        _TOOL_TURNS[tokenizer] = (found[0], found[1])
    return _TOOL_TURNS[tokenizer]


def learn(tokenizer, fmt: ToolFormat) -> ToolFormat:
    """`fmt` with the gaps and the arguments' key the template writes when it renders a call
    (unchanged when it renders none, or something unexpected)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]}]
    tool = {"type": "function", "function": {"name": SENTINEL, "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=[tool])
    except Exception:  # noqa: BLE001 -- a template that cannot render a call keeps the defaults
        return fmt
    at = text.rfind('"' + SENTINEL + '"')
    opening = text.rfind("{", 0, at)
    if at < 0 or opening < 0:
        return fmt
    key = text[at + len(SENTINEL) + 2:].lstrip(" ,\n")
    if key.startswith('"parameters"') or key.startswith('"arguments"'):
        fmt = replace(fmt, args_key=key[1:key.index('"', 1)])
    closing = json_end(text, opening)
    if fmt.start is not None:
        head = text.rfind(fmt.start.text, 0, opening)
        gap = text[head + len(fmt.start.text):opening] if head >= 0 else None
        if gap is not None and fmt.listed and gap.endswith("["):
            gap = gap[:-1]
        if gap is not None and gap.strip() == "" and len(gap) <= 2:
            fmt = replace(fmt, gap_start=gap)
    if fmt.end is not None and closing is not None:
        tail = text.find(fmt.end.text, closing)
        gap = text[closing:tail] if tail >= 0 else None
        if gap is not None and fmt.listed and gap.startswith("]"):
            gap = gap[1:]
        if gap is not None and gap.strip() == "" and len(gap) <= 2:
            fmt = replace(fmt, gap_end=gap)
    return fmt


def json_end(text: str, start: int) -> int | None:
    """The index after the JSON object or list opening at text[start], or None if it does not close."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
