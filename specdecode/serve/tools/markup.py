"""Tool calls whose arguments are not JSON: Qwen3.5's and Qwen3-Coder's XML, Gemma 4's own notation.

* `qwen3_coder` (Qwen3-Coder, Qwen3.5, Qwen3.6): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>`, a value written as text (a string as it is, anything else as
  JSON); chosen when the chat template writes `<function=` and `<parameter=`. A value becomes the
  type its parameter's JSON schema gives it (vLLM's qwen3_coder parser does the same): "34" is 34
  for an integer, "true" true for a boolean, a JSON text an object for an object.
* `gemma4` (Gemma 4): `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,xs:[1,2]}<tool_call|>`: keys bare,
  strings between `<|"|>` tokens, the rest as in JSON; chosen when the template writes `<|tool_call>`
  or the vocabulary holds `<|tool_call>` and `<tool_call|>` as one token each.

`MarkupParser` reads both as the answer streams, with `ToolParser`'s interface and deltas: a call's
name once known, then its arguments as JSON text (`{"key": value, ...}`) as they come: a parameter
at a time for the XML, as it is written for Gemma 4 (its notation turned into JSON character by
character). `call_grammar` is the forced call (tool_choice required / a named function) in the
family's own form, the arguments' values constrained by the function's schema (markup_grammar.py).
"""
from __future__ import annotations

import json
import re

from .notation import GEMMA, QUOTE
from .parser import WS, ToolParser

SCALAR_END = ",}] \t\r\n" + QUOTE[0]
MAX_NAME = 256                                # characters of a function's name: longer is not a call
NAME = re.compile(r"[^\s<>{}]+")


# ---------------------------------------------------------------------------------- values
def types_of(schema) -> list[str]:
    """The JSON types a schema allows (`type`, a list of them, `anyOf` / `oneOf` members, an enum's values)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    found = [t for key in ("anyOf", "oneOf") for sub in schema.get(key) or [] for t in types_of(sub)]
    if not found and isinstance(schema.get("enum"), list):
        found = ["string" if isinstance(v, str) else "number" for v in schema["enum"]]
    return list(dict.fromkeys(found))


def typed(raw: str, schema) -> object:
    """A parameter's text as the value its schema types it: the first of its non-string types the
    text reads as, else the text itself (a parameter the schema does not name: JSON if it reads as
    JSON, else the text)."""
    types = types_of(schema)
    text = raw.strip()
    for kind in types:
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("integer", "number", "object", "array"):
            try:
                value = json.loads(text)
            except ValueError:
                continue
            wanted = {"integer": int, "number": (int, float), "object": dict, "array": list}[kind]
            if isinstance(value, wanted) and not isinstance(value, bool):
                return value
            if kind == "integer" and isinstance(value, float) and value.is_integer():
                return int(value)
    if not types:
        try:
            return json.loads(text)
        except ValueError:
            return raw
    return raw


# ---------------------------------------------------------------------------------- the parser
class MarkupParser(ToolParser):
    """`ToolParser`'s deltas out of calls in the XML or Gemma 4 notation (`fmt.name`); `schemas`:
    each function's parameters schema, which types the XML's values."""

    def __init__(self, fmt, names: list[str] | None = None, max_calls: int | None = None,
                 schemas: dict[str, dict] | None = None) -> None:
        super().__init__(fmt, names, max_calls)
        self.schemas = schemas or {}
        self.opener = ""             # the marker that opened the current call
        self.at = 0                  # where the current call's reading goes on
        self.phase = ""              # the call's part being read
        self.json: GemmaJson | None = None
        self.params = 0              # parameters sent (XML)
        self.before = ""             # the whitespace before the current opener

    def calls_complete(self) -> bool:
        return all(c["complete"] for c in self.calls)

    def finish(self) -> list[tuple]:
        out: list[tuple] = []
        while self._advance(out, final=True):
            pass
        if self.state == "text":
            self._content(self.text[self.pos:], out, final=True)
        self.pos = len(self.text)    # a call cut short keeps what it sent; markup without a name is dropped
        if self.spaces and not self.calls:
            out.append(("content", self.spaces))
            self.spaces = ""
        return out

    def _advance(self, out: list, final: bool) -> bool:
        if self.state == "done":
            self.pos = len(self.text)
            return False
        if self.state == "text":
            return self._in_text(out, final)
        return self._in_call(out, final)

    def _in_text(self, out: list, final: bool) -> bool:
        text = self.text
        hits = [(text.find(o, self.pos), o) for o in self.openers]
        hits = [(at, o) for at, o in hits if at >= 0]
        if hits:
            at, opener = min(hits)
            self._content(text[self.pos:at], out)
            self.before, self.spaces = self.spaces, ""     # (back, if no call follows)
            self.region, self.opened, self.opener = at, at + len(opener), opener
            self.state, self.pos, self.at, self.phase = "call", at, at + len(opener), "head"
            self.region_calls = len(self.calls)
            return True
        hold = 0 if final else max((k for o in self.openers for k in range(1, len(o)) if text.endswith(o[:k])),
                                   default=0)
        end = len(text) - hold
        if end > self.pos:
            self._content(text[self.pos:end], out)
            self.pos = end
        return False

    def _not_a_call(self, out: list) -> bool:
        """What follows the opener is no call: the opener is content, the rest read again as text."""
        self.spaces = self.before
        self._content(self.text[self.region:self.opened], out)
        self.content_seen = True
        self.state, self.pos = "text", self.opened
        return True

    def _cut(self, final: bool) -> bool:
        """A call's head not yet whole: wait for more; at the answer's end (max_tokens) it is dropped,
        neither a call nor content (its markup)."""
        if final:
            self.state, self.pos = "text", len(self.text)
            return True
        return False

    def _start(self, name: str, out: list) -> None:
        call = {"id": self.fmt.call_id(), "name": name, "arguments": "", "complete": False}
        self.calls.append(call)
        self.after_call = True
        out.append(("call", len(self.calls) - 1, call["id"], name))

    def _arguments(self, piece: str, out: list) -> None:
        if piece:
            self.calls[-1]["arguments"] += piece
            out.append(("arguments", len(self.calls) - 1, piece))

    def _ended(self, at: int) -> bool:
        """The call's object is whole: the end marker, if written, is read next."""
        self.calls[-1]["complete"] = True
        self.phase, self.at = "end", at
        return True

    def _in_call(self, out: list, final: bool) -> bool:
        text, at = self.text, self.at
        if self.phase == "end":                           # the end marker, if the model wrote it
            skip = self._skip(at)
            rest, end = text[skip:], self.fmt.end.text
            if not rest and not final:
                return False
            if rest.startswith(end):
                skip += len(end)
            elif end.startswith(rest) and not final:
                return False
            else:
                skip = at
            done = self.max_calls is not None and len(self.calls) >= self.max_calls
            self.state, self.pos, self.phase = "done" if done else "text", skip, ""
            return True
        if self.fmt.name == GEMMA:
            return self._gemma(out, final)
        return self._xml(out, final)

    # ---- Qwen3-Coder / Qwen3.5's XML
    def _xml(self, out: list, final: bool) -> bool:
        text, at = self.text, self.at
        if self.phase == "head":                          # <function=NAME>
            if self.opener != "<function=":
                skip = self._skip(at)
                if skip >= len(text) or "<function=".startswith(text[skip:]):
                    return self._cut(final)
                if not text.startswith("<function=", skip):
                    return self._not_a_call(out)
                at = skip + len("<function=")
            close = text.find(">", at)
            if close < 0:
                if len(text) - at > MAX_NAME or "\n" in text[at:]:
                    return self._not_a_call(out)
                return self._cut(final)
            name = text[at:close]
            if not NAME.fullmatch(name):
                return self._not_a_call(out)
            self._start(name, out)
            self.at, self.phase, self.params = close + 1, "params", 0
            return True
        skip = self._skip(at)                             # phase "params": a parameter, or </function>
        rest = text[skip:]
        if rest.startswith("</function>"):
            self._arguments("}" if self.params else "{}", out)
            return self._ended(skip + len("</function>"))
        if rest.startswith("<parameter="):
            close = text.find(">", skip)
            ends = [(text.find(m, close + 1), m) for m in ("</parameter>", "<parameter=", "</function>")] \
                if close >= 0 else []
            ends = [(i, m) for i, m in ends if i >= 0]
            if not ends:
                return False                              # the value is still being written
            end, marker = min(ends)
            key, raw = text[skip + len("<parameter="):close], text[close + 1:end]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            schema = (self.schemas.get(self.calls[-1]["name"]) or {}).get("properties", {}).get(key)
            value = typed(raw, schema) if isinstance(schema, dict) or schema is None else raw
            piece = ("{" if not self.params else ", ") + json.dumps(key, ensure_ascii=False) + ": " + \
                json.dumps(value, ensure_ascii=False)
            self._arguments(piece, out)
            self.params += 1
            self.at = end + len(marker) if marker == "</parameter>" else end
            return True
        if not rest or "</function>".startswith(rest) or "<parameter=".startswith(rest):
            return False
        self.state, self.pos, self.phase = "text", skip, ""     # something else: the call ends, unfinished
        return True

    # ---- Gemma 4
    def _gemma(self, out: list, final: bool) -> bool:
        text, at = self.text, self.at
        if self.phase == "head":                          # call:NAME{
            rest = text[at:]
            if len(rest) < 5 and "call:".startswith(rest):
                return self._cut(final)
            if not rest.startswith("call:"):
                return self._not_a_call(out)
            brace = text.find("{", at + 5)
            if brace < 0:
                if len(text) - at > MAX_NAME or not NAME.fullmatch(text[at + 5:] or "x"):
                    return self._not_a_call(out)
                return self._cut(final)
            name = text[at + 5:brace]
            if not NAME.fullmatch(name):
                return self._not_a_call(out)
            self._start(name, out)
            self.json, self.at, self.phase = GemmaJson(), brace, "body"
            return True
        piece, used, whole = self.json.feed(text[at:], final)
        self._arguments(piece, out)
        self.at = at + used
        if whole:
            return self._ended(self.at)
        return False


class GemmaJson:
    """Gemma 4's notation turned into JSON as it comes: bare keys quoted, `<|"|>` strings as JSON
    strings, scalars checked (Python's None / True / False as JSON's), the rest as it is."""

    def __init__(self) -> None:
        self.stack: list[str] = []    # "{" / "[" of the open containers
        self.key = False              # a key comes next
        self.mode = ""                # "" | "quote" (<|"|> string) | "json" (a "..." string) | "scalar"
        self.token = ""               # the scalar or bare key read so far
        self.escaped = False

    def feed(self, text: str, final: bool) -> tuple[str, int, bool]:
        """(JSON text, characters of `text` used, the object closed)."""
        out, i, n = [], 0, len(text)
        while i < n:
            c = text[i]
            if self.mode == "quote":
                end = text.find(QUOTE, i)
                if end < 0:
                    hold = max((k for k in range(1, len(QUOTE)) if text.endswith(QUOTE[:k])), default=0)
                    hold = 0 if final else hold
                    out.append(json.dumps(text[i:n - hold], ensure_ascii=False)[1:-1])
                    i = n - hold
                    break
                out.append(json.dumps(text[i:end], ensure_ascii=False)[1:-1] + '"')
                i, self.mode = end + len(QUOTE), ""
                if self.key:
                    self.key = False
                continue
            if self.mode == "json":
                out.append(c)
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.mode = ""
                    self.key = False
                i += 1
                continue
            if self.mode == "scalar":
                if c not in SCALAR_END and c != ":":
                    self.token += c
                    i += 1
                    continue
                out.append(self._scalar())
                self.mode = ""
                continue
            if text.startswith(QUOTE, i):
                out.append('"')
                self.mode, i = "quote", i + len(QUOTE)
                continue
            if QUOTE.startswith(text[i:]) and not final:
                break
            i += 1
            if c in WS:
                continue
            if c in "{[":
                self.stack.append(c)
                self.key = c == "{"
                out.append(c)
            elif c in "}]":
                if self.stack:
                    self.stack.pop()
                out.append(c)
                self.key = False
                if not self.stack:
                    return "".join(out), i, True
            elif c == ",":
                out.append(", ")
                self.key = bool(self.stack) and self.stack[-1] == "{"
            elif c == ":":
                out.append(": ")
            elif c == '"':
                out.append(c)
                self.mode = "json"
            else:
                self.mode, self.token = "scalar", c
        if final and self.mode == "scalar":
            out.append(self._scalar())
            self.mode = ""
        return "".join(out), i, False

    def _scalar(self) -> str:
        token, self.token = self.token, ""
        if self.key:                                      # a bare key
            self.key = False
            return json.dumps(token, ensure_ascii=False)
        token = {"None": "null", "True": "true", "False": "false"}.get(token, token)
        try:
            json.loads(token)
            return token
        except ValueError:
            return json.dumps(token, ensure_ascii=False)
