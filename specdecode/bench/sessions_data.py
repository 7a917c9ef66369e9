"""The sessions of `specdecode bench sessions`: reading and checking a sessions file, and the
conversation each session grows into, turn by turn.

A sessions file is JSONL, one session per line (the shipped one: specdecode/data/sessions/):

    {"id": str, "kind": "edit" | "tools" | "document", "title": str, "system": str (optional),
     "turns": [{"user": str, "call": str, "tool_result": str}, ...], plus by kind:
     edit: "file" (the Python file; the first turn's user text holds "{file}" where it goes, fenced),
     document: "document" (the first turn's user text holds "{document}"),
     tools: "tools" (OpenAI function schemas); every turn has "tool_result" (the canned result of the
            call that turn makes; "call" names the function the scenario expects) and turns after the
            first may leave out "user" (the model then goes on from the tool result alone)}

How a conversation grows (Conversation): the model's own answer of each turn is appended before
the next turn's message. Tools: an answer with tool calls is appended with them (their ids
replaced by call_<turn>_<i>, so that both speculation arms send the same bytes) and each call gets
a "tool" message with the turn's result; an answer in text instead is appended as text, and the
result then reaches the model as a user message ("Output of <call>: ..."), followed by the next
turn's user text if it has one, so a model that never calls tools still gets the same material.
Edit sessions track the current file for Predicted Outputs: the original file for the first turn,
then the last complete code block of the previous answer (the file before, if it has none).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

KINDS = ("edit", "tools", "document")
DEFAULT_FILE = Path(__file__).resolve().parent.parent / "data" / "sessions" / "sessions.jsonl"
CODE_BLOCK = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
PLACEHOLDER = {"edit": "{file}", "document": "{document}"}


class SessionDataError(ValueError):
    """A sessions file that cannot be used (the message names the file, line and field)."""


@dataclass(frozen=True)
class Turn:
    user: str | None
    call: str | None = None          # tools: the function the scenario expects this turn to call
    tool_result: str | None = None   # tools: what that call returns


@dataclass(frozen=True)
class Session:
    id: str
    kind: str
    title: str
    turns: tuple[Turn, ...]
    system: str | None = None
    tools: tuple | None = None       # OpenAI [{"type": "function", "function": {...}}]
    file: str | None = None          # edit: the Python file of the first turn
    document: str | None = None      # document: the document of the first turn

    def first_message(self) -> str:
        """The first user message, with the file (fenced) or the document in place."""
        text = self.turns[0].user or ""
        if self.kind == "edit":
            return text.replace("{file}", f"```python\n{self.file.rstrip()}\n```\n", 1)
        if self.kind == "document":
            return text.replace("{document}", self.document.strip(), 1)
        return text


def check_tool(tool, where: str) -> str:
    """The function name of one OpenAI tool schema, or SessionDataError."""
    f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not re.fullmatch(r"[A-Za-z_][\w-]*", f["name"]):
        raise SessionDataError(f"{where} must be {{'type': 'function', 'function': {{'name': identifier, ...}}}}")
    params = f.get("parameters", {"type": "object"})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise SessionDataError(f"{where}.function.parameters must be a JSON schema of type object")
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise SessionDataError(f"{where}.function.parameters.properties must map names to schemas")
    required = params.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(props):
        raise SessionDataError(f"{where}.function.parameters.required names properties it does not define")
    return f["name"]


def parse_session(row, where: str) -> Session:
    if not isinstance(row, dict):
        raise SessionDataError(f"{where}: a session must be a JSON object")
    sid, kind = row.get("id"), row.get("kind")
    if not isinstance(sid, str) or not sid:
        raise SessionDataError(f"{where}: 'id' must be a non-empty string")
    where = f"{where} ({sid})"
    if kind not in KINDS:
        raise SessionDataError(f"{where}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    turns_raw = row.get("turns")
    if not isinstance(turns_raw, list) or not turns_raw:
        raise SessionDataError(f"{where}: 'turns' must be a non-empty list")
    turns = []
    for i, t in enumerate(turns_raw):
        if not isinstance(t, dict):
            raise SessionDataError(f"{where}: turns[{i}] must be an object")
        user, call, result = t.get("user"), t.get("call"), t.get("tool_result")
        if user is not None and (not isinstance(user, str) or not user.strip()):
            raise SessionDataError(f"{where}: turns[{i}].user must be a non-empty string")
        if user is None and (i == 0 or kind != "tools"):
            raise SessionDataError(f"{where}: turns[{i}] needs 'user'" + (" (only tools sessions may leave it out "
                                                                         "after the first turn)" if i else ""))
        if kind == "tools" and (not isinstance(result, str) or not result.strip()):
            raise SessionDataError(f"{where}: turns[{i}].tool_result must be a non-empty string in a tools session")
        turns.append(Turn(user, call, result))
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise SessionDataError(f"{where}: 'system' must be a string")
    tools = None
    if kind == "tools":
        raw = row.get("tools")
        if not isinstance(raw, list) or not raw:
            raise SessionDataError(f"{where}: a tools session needs 'tools', a non-empty list of function schemas")
        names = [check_tool(tool, f"{where}: tools[{i}]") for i, tool in enumerate(raw)]
        for i, t in enumerate(turns):
            if t.call is not None and t.call not in names:
                raise SessionDataError(f"{where}: turns[{i}].call {t.call!r} is none of its tools ({', '.join(names)})")
        tools = tuple(raw)
    content = {}
    if kind in PLACEHOLDER:
        field = "file" if kind == "edit" else "document"
        value = row.get(field)
        if not isinstance(value, str) or not value.strip():
            raise SessionDataError(f"{where}: a {kind} session needs '{field}', a non-empty string")
        if turns[0].user.count(PLACEHOLDER[kind]) != 1:
            raise SessionDataError(f"{where}: turns[0].user must hold {PLACEHOLDER[kind]} once "
                                   f"(where the {field} goes)")
        content[field] = value
    title = row.get("title", sid)
    return Session(sid, kind, str(title), tuple(turns), system, tools, **content)


def load(path: str | Path | None = None) -> list[Session]:
    """Every session of a sessions file (default: the shipped one), checked."""
    path = Path(path).expanduser() if path is not None else DEFAULT_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SessionDataError(f"cannot read {path}: {exc.strerror or exc}") from None
    sessions, seen = [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SessionDataError(f"{path}:{number}: not JSON: {exc}") from None
        session = parse_session(row, f"{path}:{number}")
        if session.id in seen:
            raise SessionDataError(f"{path}:{number}: duplicate session id {session.id!r}")
        seen.add(session.id)
        sessions.append(session)
    if not sessions:
        raise SessionDataError(f"{path}: no sessions")
    return sessions


def select(sessions: list[Session], kinds: list[str], per_kind: int | None) -> list[Session]:
    """The first `per_kind` sessions of each kind, kinds in the order asked."""
    return [s for kind in kinds for s in [x for x in sessions if x.kind == kind][:per_kind]]


def last_code_block(text: str) -> str | None:
    blocks = CODE_BLOCK.findall(text or "")
    return blocks[-1] if blocks else None


class Conversation:
    """One session's messages as they grow. `next_messages(t)` before turn t (0-based) returns the
    request's messages; `add_answer(t, text, calls)` appends the model's answer of turn t."""

    def __init__(self, session: Session, turns: int | None = None) -> None:
        self.session = session
        self.turns = min(len(session.turns), turns or len(session.turns))
        self.messages: list[dict] = [{"role": "system", "content": session.system}] if session.system else []
        self.file = session.file              # edit: the current file (the prediction of the next turn)
        self.last_calls: list[dict] = []
        self.failed: str | None = None        # the error that stopped the session

    def next_messages(self, t: int) -> list[dict]:
        s = self.session
        if t == 0:
            self.messages.append({"role": "user", "content": s.first_message()})
            return list(self.messages)
        pasted = None
        if s.kind == "tools":
            previous = s.turns[t - 1]
            if self.last_calls:
                for call in self.last_calls:
                    self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": previous.tool_result})
            else:
                pasted = f"Output of {previous.call or 'the tool'}:\n{previous.tool_result}"
        user = s.turns[t].user
        text = "\n\n".join(x for x in (pasted, user) if x)
        if text:
            self.messages.append({"role": "user", "content": text})
        return list(self.messages)

    def add_answer(self, t: int, text: str, calls: list[dict]) -> None:
        if calls:
            self.last_calls = [{"id": f"call_{t + 1}_{i}", "type": "function",
                                "function": {"name": c.get("function", {}).get("name", ""),
                                             "arguments": c.get("function", {}).get("arguments", "")}}
                               for i, c in enumerate(calls)]
            self.messages.append({"role": "assistant", "content": text or None, "tool_calls": self.last_calls})
        else:
            self.last_calls = []
            self.messages.append({"role": "assistant", "content": text})
        if self.session.kind == "edit":
            self.file = last_code_block(text) or self.file
