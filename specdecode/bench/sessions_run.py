"""The client side of `specdecode bench sessions`: each turn of a session is one streaming request
to /v1/chat/completions; groups of sessions advance turn by turn in lockstep.

Timing of one turn (client-side, perf_counter): TTFT = send to the first chunk that carries text,
a tool call or token kinds; e2e = send to `data: [DONE]`; decode tok/s = (output tokens - 1) /
(e2e - TTFT), only when the answer came in two or more such chunks (specdecode's server holds the
text of a request with `tools` back until the end, to parse calls from it: its tools turns then
have a TTFT close to e2e and no decode rate; their output tok/s, tokens / e2e, still compares).

From the server, when it sends them: `usage` (output and prompt tokens,
prompt_tokens_details.cached_tokens, completion_tokens_details.accepted_prediction_tokens /
rejected_prediction_tokens), specdecode's `speculation` object on the finishing chunk (accepted
and drafted tokens), and `token_kinds` per chunk (when the request asks for them, --extra-body).
Fields a server does not send stay null.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from .serve_load import StreamFailed, stream_chunks
from .sessions_data import Conversation, Session


@dataclass
class Settings:
    """What every request of a run sends besides its messages."""
    model: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    tool_choice: str = "auto"
    prediction: bool = False
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0


@dataclass
class TurnRecord:
    kind: str
    session: str
    cache: str                    # "on" / "off": the server's prefix cache (as started; "server" with --url)
    arm: str                      # speculation: "on" / "off" (field sent) or "server" (left to the server)
    turn: int                     # 1-based
    group: int
    start: float = 0.0            # seconds since the run's start
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int | None = None
    tokens_from: str | None = None        # "usage", "token_kinds" or "chunks"
    chunks: int = 0                       # chunks that carried text, tool calls or token kinds
    decode_tok_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    accepted_tokens: int | None = None
    drafted_tokens: int | None = None
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    prediction_chars: int | None = None   # the prediction sent (edit sessions with --prediction)
    finish_reason: str | None = None
    tool_calls: int = 0
    answer_chars: int = 0
    answer_sha1: str | None = None        # of the answer's text and calls: arms are compared by it

    def as_dict(self) -> dict:
        row = asdict(self)
        for key in ("start", "ttft", "e2e"):
            if row[key] is not None:
                row[key] = round(row[key], 6)
        if row["decode_tok_s"] is not None:
            row["decode_tok_s"] = round(row["decode_tok_s"], 3)
        return row


@dataclass
class Answer:
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    text: str = ""
    calls: list[dict] = field(default_factory=list)
    usage: dict | None = None
    speculation: dict | None = None
    kinds: dict[str, int] = field(default_factory=dict)
    chunks: int = 0
    finish_reason: str | None = None


def request_body(conv: Conversation, t: int, messages: list[dict], settings: Settings, arm: str) -> dict:
    body: dict = {"model": settings.model, "messages": messages, "max_tokens": settings.max_tokens,
                  "temperature": settings.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if settings.seed is not None and settings.temperature > 0:
        body["seed"] = settings.seed
    session = conv.session
    if session.kind == "tools":
        body["tools"] = list(session.tools)
        body["tool_choice"] = settings.tool_choice
    if settings.prediction and session.kind == "edit" and conv.file:
        body["prediction"] = {"type": "content", "content": conv.file}
    if arm in ("on", "off"):
        body["speculate"] = arm == "on"
    body.update(settings.extra_body)
    return body


def add_call_delta(calls: list[dict], delta: dict) -> None:
    """Accumulate one streamed tool-call delta (OpenAI: by index; id and name once, arguments in pieces)."""
    index = delta.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call, fn = calls[index], delta.get("function") or {}
    call["id"] = delta.get("id") or call["id"]
    call["function"]["name"] += fn.get("name") or ""
    args = fn.get("arguments")
    call["function"]["arguments"] += args if isinstance(args, str) else (json.dumps(args) if args else "")


async def stream_chat(client: httpx.AsyncClient, body: dict, timeout_s: float) -> Answer:
    """One streaming chat request (never raises for request failures: Answer.error says what went wrong)."""
    answer = Answer()
    start = time.perf_counter()
    try:
        async for chunk in stream_chunks(client, "/v1/chat/completions", body, timeout_s,
                                         lambda status: setattr(answer, "status", status)):
            if chunk.get("usage"):
                answer.usage = chunk["usage"]
            if chunk.get("speculation"):
                answer.speculation = chunk["speculation"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                text = delta.get("content") or ""
                kinds = choice.get("token_kinds") or []
                for token in kinds:
                    answer.kinds[token.get("kind", "")] = answer.kinds.get(token.get("kind", ""), 0) + 1
                for call in delta.get("tool_calls") or []:
                    add_call_delta(answer.calls, call)
                if text or kinds or delta.get("tool_calls"):
                    if answer.ttft is None:
                        answer.ttft = time.perf_counter() - start
                    answer.chunks += 1
                    answer.text += text
                if choice.get("finish_reason"):
                    answer.finish_reason = choice["finish_reason"]
    except StreamFailed as exc:
        answer.error = str(exc)
        return answer
    answer.e2e = time.perf_counter() - start
    return answer


def fingerprint(text: str, calls: list[dict]) -> str:
    named = [[c["function"]["name"], c["function"]["arguments"]] for c in calls]
    return hashlib.sha1(json.dumps([text, named], ensure_ascii=False).encode()).hexdigest()


def fill(record: TurnRecord, answer: Answer) -> None:
    """The turn's numbers from a finished answer."""
    record.status, record.error, record.ttft, record.e2e = answer.status, answer.error, answer.ttft, answer.e2e
    record.finish_reason, record.chunks = answer.finish_reason, answer.chunks
    if answer.error is not None:
        return
    record.ok = True
    record.tool_calls = len(answer.calls)
    record.answer_chars = len(answer.text)
    record.answer_sha1 = fingerprint(answer.text, answer.calls)
    usage = answer.usage or {}
    if usage.get("completion_tokens") is not None:
        record.output_tokens, record.tokens_from = int(usage["completion_tokens"]), "usage"
    elif answer.kinds:
        record.output_tokens, record.tokens_from = sum(answer.kinds.values()), "token_kinds"
    else:
        record.output_tokens, record.tokens_from = answer.chunks, "chunks"
    if usage.get("prompt_tokens") is not None:
        record.prompt_tokens = int(usage["prompt_tokens"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    record.cached_tokens = int(cached) if cached is not None else None
    details = usage.get("completion_tokens_details") or {}
    for key in ("accepted_prediction_tokens", "rejected_prediction_tokens"):
        if details.get(key) is not None:
            setattr(record, key, int(details[key]))
    spec = answer.speculation
    if isinstance(spec, dict) and spec.get("accepted_tokens") is not None:
        record.accepted_tokens = int(spec["accepted_tokens"])
        record.drafted_tokens = int(spec["drafted_tokens"]) if spec.get("drafted_tokens") is not None else None
    elif answer.kinds:
        record.accepted_tokens = answer.kinds.get("accepted", 0)
    if (record.output_tokens or 0) >= 2 and answer.chunks >= 2 and answer.e2e > answer.ttft:
        record.decode_tok_s = (record.output_tokens - 1) / (answer.e2e - answer.ttft)


async def run_turn(client: httpx.AsyncClient, conv: Conversation, t: int, settings: Settings, arm: str,
                   cache: str, group: int, t0: float) -> TurnRecord:
    session = conv.session
    record = TurnRecord(session.kind, session.id, cache, arm, t + 1, group)
    body = request_body(conv, t, conv.next_messages(t), settings, arm)
    if "prediction" in body:
        record.prediction_chars = len(conv.file)
    record.start = time.perf_counter() - t0
    answer = await stream_chat(client, body, settings.timeout_s)
    fill(record, answer)
    if record.ok:
        conv.add_answer(t, answer.text, answer.calls)
    else:
        conv.failed = record.error
    return record


async def run_group(client: httpx.AsyncClient, sessions: list[Session], settings: Settings, arm: str, cache: str,
                    group: int, turns: int | None, round_robin: bool, t0: float
                    ) -> tuple[list[TurnRecord], list[Conversation]]:
    """The sessions of one group, turn by turn in lockstep: all their turn t (at once, or one after
    another with `round_robin`) before any turn t + 1. A session whose turn fails stops there."""
    convs = [Conversation(s, turns) for s in sessions]
    records: list[TurnRecord] = []
    for t in range(max(c.turns for c in convs)):
        active = [c for c in convs if t < c.turns and c.failed is None]
        if round_robin:
            for c in active:
                records.append(await run_turn(client, c, t, settings, arm, cache, group, t0))
        else:
            records += await asyncio.gather(*(run_turn(client, c, t, settings, arm, cache, group, t0)
                                              for c in active))
    return records, convs


async def probe(client: httpx.AsyncClient, settings: Settings, arms: list[str]) -> dict:
    """Warm-up requests (one without the speculate field, then one per speculation arm), unmeasured;
    what the server reports: specdecode's `speculation` object, usage, cached_tokens."""
    seen = {"speculation": False, "usage": False, "cached_tokens": False, "errors": []}
    for arm in ["server", *[a for a in arms if a != "server"]]:
        body = {"model": settings.model, "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Warm-up: name three colours of the rainbow."}]}
        if arm in ("on", "off"):
            if not seen["speculation"]:
                break                        # not specdecode: the speculate field means nothing there
            body["speculate"] = arm == "on"
        answer = await stream_chat(client, body, settings.timeout_s)
        if answer.error:
            seen["errors"].append(answer.error)
            continue
        seen["speculation"] |= isinstance(answer.speculation, dict)
        seen["usage"] |= bool(answer.usage)
        seen["cached_tokens"] |= ((answer.usage or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens") is not None
    return seen
