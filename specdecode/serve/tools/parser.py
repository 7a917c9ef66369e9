"""Tool calls out of a model's answer as it streams: OpenAI's deltas, in the model's own format.

`ToolParser.feed(text)` takes the answer's next text (marker tokens decoded as their text) and
returns what may be sent now: `("content", text)`, `("call", index, id, name)` once a call's
name is complete, `("arguments", index, text)` as its arguments' JSON grows. Text that may still
turn out to open a call (a marker's first characters, an answer that so far is only whitespace in
a format whose calls are bare JSON) is held back until it is known. `finish()` sends the rest.
A non-streamed answer is the same deltas put together, so both say the same. Besides the
format's markers, an answer that starts with a call object naming one of the request's functions
(bare, or in a ```json fence) is a call: Llama 3's way, and what small models often write.

Arguments are the raw JSON text the model wrote for them (the `arguments` / `parameters` value),
sent as it comes; a call cut short (max_tokens) keeps the arguments written so far, as OpenAI's
does. Text inside markers that is not a call object with a string "name" goes to the content.
"""
from __future__ import annotations

import json

from .formats import HERMES, ToolFormat

WS = " \t\r\n"


class CallScan:
    """One call object, scanned as its text grows: the name, and where the arguments' value is."""

    def __init__(self, start: int, args_keys: tuple[str, ...]) -> None:
        self.start, self.args_keys = start, args_keys
        self.pos = start + 1                 # text[start] is "{"
        self.depth, self.in_string, self.escaped = 1, False, False
        self.phase = "key"                   # key | colon | value | comma (at depth 1)
        self.key_start = self.value_start = -1
        self.key: str | None = None
        self.keys: list[str] = []
        self.name: str | None = None
        self.args = (-1, -1)                 # the arguments' value: [start, end) (end -1: still open)
        self.end = -1                        # after the closing "}"
        self.bad = False                     # not a call object

    def scan(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end < 0 and not self.bad:
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 1:
                        self._string_done(text, i + 1)
            elif self.depth == 1 and self.phase == "key":
                if c == '"':
                    self.in_string, self.key_start = True, i
                elif c == "}" and not self.keys:
                    self.depth, self.end = 0, i + 1
                elif c not in WS:
                    self.bad = True
            elif self.depth == 1 and self.phase == "colon":
                if c == ":":
                    self.phase = "value"
                elif c not in WS:
                    self.bad = True
            elif self.depth == 1 and self.phase == "value" and self.value_start < 0:
                if c not in WS:
                    self.value_start = i
                    if self.key in self.args_keys:
                        self.args = (i, -1)
                    if c == '"':
                        self.in_string = True
                    elif c in "{[":
                        self.depth += 1
                    elif c in ",}]:":
                        self.bad = True
            elif self.depth == 1 and self.phase == "value":      # a scalar value (number, true, ...)
                if c in WS + ",}":
                    self._value_done(i)
                    continue                                     # the comma / brace again, as "comma"
            elif self.depth == 1:                                # phase "comma"
                if c == ",":
                    self.phase = "key"
                elif c == "}":
                    self.depth, self.end = 0, i + 1
                elif c not in WS:
                    self.bad = True
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_done(i + 1)
            i += 1
        self.pos = i

    def _string_done(self, text: str, end: int) -> None:
        if self.phase == "key":
            self.key = _string(text[self.key_start:end])
            self.keys.append(self.key or "")
            self.phase = "colon"
        else:
            self._value_done(end, text)

    def _value_done(self, end: int, text: str | None = None) -> None:
        if self.key == "name" and text is not None and self.name is None:
            self.name = _string(text[self.value_start:end])
        if self.key in self.args_keys and self.args[1] < 0:
            self.args = (self.args[0], end)
        self.phase, self.value_start = "comma", -1


def _string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


class ToolParser:
    def __init__(self, fmt: ToolFormat = HERMES, names: list[str] | None = None, max_calls: int | None = None) -> None:
        """names: the request's functions; a bare call (below) must name one (None: any name);
        max_calls: the answer ends for the parser after that many calls (parallel_tool_calls false: 1)."""
        self.fmt, self.names, self.max_calls = fmt, names, max_calls
        self.args_keys = tuple(dict.fromkeys((fmt.args_key, "arguments", "parameters")))
        self.openers = [m.text for m in fmt.markers() if m is not fmt.end]
        self.text = ""
        self.pos = 0                 # everything before has been decided
        self.state = "text"          # text | open (after an opener) | call | after (a call) | end (its marker)
                                     # | done (max_calls made)
        self.in_list = False
        self.bare = self.fenced = False   # the current call opened without a marker / inside a ``` fence
        self.region = self.opened = -1   # the current opener's start and end (its text is content if no call follows)
        self.region_calls = 0        # calls before the current opener
        self.scan: CallScan | None = None
        self.calls: list[dict] = []  # {"id", "name", "arguments" (sent so far), "sent", "scan"}
        self.spaces = ""             # whitespace-only content held until more content follows
        self.content_seen = False
        self.after_call = False      # no content since the last call: its leading whitespace is dropped

    # ------------------------------------------------------------------ the answer's text
    def feed(self, text: str) -> list[tuple]:
        if self.state == "done":
            return []
        self.text += text
        out: list[tuple] = []
        while self._advance(out, final=False):
            pass
        if self.state == "text" and self.pos > 4096:     # decided text is not read again: a long answer
            self.text, self.pos = self.text[self.pos:], 0  # is not copied whole at every step
        return out

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        while self._advance(out, final=True):
            pass
        opened = self.state in ("open", "call") and len(self.calls) == self.region_calls
        if self.state == "text" or (opened and self.bare):
            rest = self.text[self.pos if self.state == "text" else self.region:]
            self._content(rest, out, final=True)
            self.pos = len(self.text)
        elif opened:      # a marker opened a call that ended (max_tokens) before its name: not content
            self.pos = len(self.text)
        if self.spaces and not self.calls:
            out.append(("content", self.spaces))
            self.spaces = ""
        return out

    def result(self, final_text: str) -> tuple[str | None, list[dict]]:
        """(content or None, OpenAI tool_calls) of a whole answer."""
        deltas = self.feed(final_text) + self.finish()
        content = "".join(d[1] for d in deltas if d[0] == "content").strip()
        return content or None, self.tool_calls()

    def calls_complete(self) -> bool:
        """Did every call's object close (a stop string or max_tokens can cut one short)?"""
        return all(c["scan"].end >= 0 for c in self.calls)

    def tool_calls(self) -> list[dict]:
        return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in self.calls]

    # ------------------------------------------------------------------ the state machine
    def _advance(self, out: list, final: bool) -> bool:
        """One move; False when nothing more can be decided with the text so far."""
        text, fmt = self.text, self.fmt
        if self.state == "text":
            return self._in_text(out, final)
        if self.state == "open":                     # after an opener: "[" of a list, or "{" of a call
            at = self._skip(self.pos)
            if at >= len(text):
                return False
            if (fmt.listed or self.bare) and text[at] == "[" and not self.in_list:   # a list of calls
                self.in_list, self.pos = True, at + 1
                return True
            if text[at] == "{":
                self.scan, self.state = CallScan(at, self.args_keys), "call"
                return True
            return self._not_a_call(out)
        if self.state == "call":
            return self._in_call(out)
        if self.state == "done":                      # max_calls made: the rest is neither content nor calls
            self.pos = len(text)
            return False
        if self.state == "after":                     # after a call: another, the list's end, the end marker
            at = self._skip(self.pos)
            if at >= len(text):
                if final and not self.in_list:
                    self.state, self.pos = "text", at
                return False
            if self.in_list and text[at] == ",":
                self.state, self.pos = "open", at + 1
                return True
            if self.in_list and text[at] == "]":
                self.in_list, self.pos = False, at + 1
                return True
            if self.bare and text[at] == "{":         # another call object after a bare one (a fence of
                self.state, self.pos = "open", at     # calls, one per line: Qwen2.5-Coder's "auto"); text
                self.region, self.opened, self.region_calls = at, at + 1, len(self.calls)   # if it is none
                return True
            if self.bare and self.fenced:             # the fence's end, if written
                if text.startswith("```", at):
                    self.state, self.pos, self.fenced = "text", at + 3, False
                    return True
                if "```".startswith(text[at:]) and not final:
                    return False
                self.state, self.pos = "text", at
                return True
            if self.bare and fmt.start is None and text[at] == ";":
                self.state, self.pos = "open", at + 1
                return True
            if fmt.end is not None and not self.bare:
                self.state, self.pos = "end", at
                return True
            self.state = "text"
            return True
        if self.state == "end":                       # the end marker, if the model wrote it
            rest = text[self.pos:]
            if rest.startswith(fmt.end.text):
                self.state, self.pos = "text", self.pos + len(fmt.end.text)
                return True
            if fmt.end.text.startswith(rest) and not final:
                return False
            self.state = "text"
            return True
        return False

    def _in_text(self, out: list, final: bool) -> bool:
        text = self.text
        hits = [(text.find(o, self.pos), o) for o in self.openers]
        hits = [(at, o) for at, o in hits if at >= 0]
        lead, bare_at, fenced = self._skip(self.pos), None, False
        if not self.content_seen and not self.calls:  # the answer's start: a bare or fenced call?
            bare_at, fenced = self._bare_start(lead)
            if bare_at == -1 and not final:
                return False                          # not known yet: held
        if bare_at is not None and bare_at >= 0 and (not hits or lead <= min(hits)[0]):
            self.spaces = ""
            self.region, self.opened, self.pos, self.state = lead, bare_at + 1, bare_at, "open"
            self.region_calls, self.bare, self.fenced = len(self.calls), True, fenced
            return True
        if hits:
            at, opener = min(hits)
            self._content(text[self.pos:at], out)
            self.spaces = ""
            self.region, self.opened, self.pos, self.state = at, at + len(opener), at + len(opener), "open"
            self.region_calls, self.bare, self.fenced = len(self.calls), False, False
            return True
        hold = 0 if final else max((k for o in self.openers for k in range(1, len(o))
                                    if text.endswith(o[:k])), default=0)
        end = len(text) - hold
        if end > self.pos:
            self._content(text[self.pos:end], out)
            self.pos = end
        return False

    def _in_call(self, out: list) -> bool:
        scan = self.scan
        scan.scan(self.text)
        if scan.bad or (self.bare and scan.keys and scan.keys[0] != "name") or \
                (self.bare and scan.name is not None and self.names is not None and scan.name not in self.names):
            return self._not_a_call(out)
        call = self.calls[-1] if self.calls and self.calls[-1]["scan"] is scan else None
        if call is None and scan.name is not None:
            call = {"id": self.fmt.call_id(), "name": scan.name, "arguments": "", "sent": 0, "scan": scan}
            self.calls.append(call)
            self.after_call = True
            out.append(("call", len(self.calls) - 1, call["id"], call["name"]))
        if call is not None:
            self._send_arguments(call, out)
        if scan.end < 0:
            return False
        if call is None:                              # a whole object without a name: not a call
            return self._not_a_call(out)
        done = self.max_calls is not None and len(self.calls) >= self.max_calls
        self.state, self.pos, self.scan = "done" if done else "after", scan.end, None
        return True

    def _send_arguments(self, call: dict, out: list) -> None:
        start, end = call["scan"].args
        if start < 0:
            return
        raw = self.text[start:end if end >= 0 else call["scan"].pos]
        if self.text[start] == '"':                   # arguments given as a JSON string: its content, once whole
            if end < 0:
                return
            value = _string(raw)
            raw = value if value is not None else raw
        new = raw[call["sent"]:]
        if new:
            call["arguments"] += new
            call["sent"] = len(raw)
            out.append(("arguments", self.calls.index(call), new))

    def _not_a_call(self, out: list) -> bool:
        """What follows the opener is not a call: the opener is content, and the text after it is
        read again as text. A call whose name was sent ends where its object stops making sense."""
        if len(self.calls) > self.region_calls:
            self.state, self.pos = "text", self.scan.pos - 1 if self.scan is not None else self.pos
        else:
            self._content(self.text[self.region:self.opened], out)
            self.content_seen = True
            self.state, self.pos = "text", self.opened
        self.scan, self.in_list, self.bare, self.fenced = None, False, False, False
        return True

    def _bare_start(self, lead: int) -> tuple[int | None, bool]:
        """At the answer's start (`lead`: its first non-space): (where a call object without a marker
        opens, or None when there is none, or -1 while the text does not tell yet; inside a ```json
        fence). Llama 3 writes its calls so; other models do it too (Qwen2.5-Coder-1.5B answers
        "auto" with a fenced {"name": ..., "arguments": ...}). It is a call when its first key is
        "name" and names one of the request's functions."""
        text = self.text
        if lead >= len(text):
            return -1, False
        if text[lead] in "{[":
            return self._object_or_list(lead), False
        if not text.startswith("```", lead):
            return (-1, False) if "```".startswith(text[lead:]) else (None, False)
        line = text.find("\n", lead)
        if line < 0:
            return -1, False
        if text[lead + 3:line].strip().lower() not in ("", "json"):
            return None, False
        at = self._skip(line + 1)
        if at >= len(text):
            return -1, False
        found = self._object_or_list(at) if text[at] in "{[" else None
        return found, found is not None and found >= 0

    def _object_or_list(self, at: int) -> int | None:
        """text[at] is "{" or "[": `at` for an object, or for a list whose first item is one (a list
        of calls; Mistral's "[TOOL_CALLS]" is not); None when it is not, -1 while it does not tell."""
        if self.text[at] == "{":
            return at
        first = self._skip(at + 1)
        if first >= len(self.text):
            return -1
        return at if self.text[first] == "{" else None

    def _skip(self, at: int) -> int:
        while at < len(self.text) and self.text[at] in WS:
            at += 1
        return at

    def _content(self, piece: str, out: list, final: bool = False) -> None:
        """Content text; whitespace at its end waits for what follows (dropped before a call, and at
        the end of an answer with calls), so the deltas do not depend on how the text was cut."""
        if self.after_call:
            piece, self.spaces = piece.lstrip(WS), ""
        words = piece.rstrip(WS)
        if not words:
            if not final:
                self.spaces += piece
            return
        self.content_seen, self.after_call = True, False
        out.append(("content", self.spaces + words))
        self.spaces = piece[len(words):]


def openai_deltas(deltas: list[tuple]) -> list[dict]:
    """The parser's deltas (tools/parser.py) as OpenAI's chunk deltas: content; a call's
    `index`, `id`, `type` and `function.name` (arguments ""); then its `function.arguments`
    pieces (one chunk per call per step)."""
    out: list[dict] = []
    for kind, *rest in deltas:
        last = out[-1] if out else {}
        if kind == "content":
            if "content" in last:
                last["content"] += rest[0]
            else:
                out.append({"content": rest[0]})
        elif kind == "call":
            index, call_id, name = rest
            out.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
        else:
            index, piece = rest
            call = last["tool_calls"][0] if "tool_calls" in last else None
            if call is not None and call["index"] == index and "id" not in call:
                call["function"]["arguments"] += piece
            else:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return out


def extract_calls(text: str, fmt: ToolFormat = HERMES) -> tuple[str | None, list[dict]]:
    """(the text outside tool calls or None when empty, OpenAI tool_calls) of a finished answer;
    without calls the text is returned unchanged."""
    content, calls = ToolParser(fmt).result(text)
    return (content, calls) if calls else (text, [])
