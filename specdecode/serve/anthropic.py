"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens (Claude Code's API).

A request is translated into the chat completions body it means (anthropic_request.py) and parsed
by `protocol.parse`, then runs as one `Generation` on the same engine, mailbox, text stream, tool
parser and (for thinking models) reasoning parser as /v1/chat/completions. Only the output differs:
content blocks (`thinking`, `text`, `tool_use` with the parsed call's arguments as `input`),
Anthropic's stop reasons and usage, its server-sent events, and its error shape.

`max_tokens` beyond the room the prompt leaves (in the context and in the KV pool) is clamped to
that room: Anthropic's clients ask for far more than a local model's context holds. `usage` follows
the API: `input_tokens` are the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` those that were; `message_start` reports the whole prompt as input (the
cache hit is known once the request is admitted) and `message_delta` the final split.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import uuid

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.sequence import Finished, QueueFull, ShuttingDown, Tokens
from .anthropic_request import MessagesRequest, translate
from .errors import ApiError, anthropic_error_body, read_json
from .events import Mailbox, drain, merge_tokens

log = logging.getLogger("specdecode.serve")
PATHS = ("/v1/messages", "/v1/messages/count_tokens")
KEEPALIVE_S = 10.0            # a ping while a long prompt is read, so that no client times the stream out


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status)


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class Blocks:
    """The answer's content blocks as the parsers decide them: the stream's events (name, data) for
    each piece, and the whole message's `content`. A block opens when its first piece comes and
    closes when a piece of another block comes, so no block is empty."""

    def __init__(self) -> None:
        self.content: list[dict] = []
        self.open: str | None = None          # "thinking" | "text" | "tool_use" (the last block's)
        self.call_at: dict[int, int] = {}     # the tool parser's call index -> block index
        self.arguments: dict[int, str] = {}   # block index -> its input's JSON text so far
        self.pinged = False

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.content.append(block)
        self.open = block["type"]
        shown = dict(block, input={}) if block["type"] == "tool_use" else dict(block)
        events.append(("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                               "content_block": shown}))
        if not self.pinged:                   # the API's order: the first block's start, then a ping
            self.pinged = True
            events.append(("ping", {"type": "ping"}))
        return events

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                       "delta": delta}

    def thinking(self, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        events = self._start({"type": "thinking", "thinking": "", "signature": ""}) if self.open != "thinking" else []
        self.content[-1]["thinking"] += text
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        events = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        self.content[-1]["text"] += text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def tool_deltas(self, deltas: list[tuple]) -> list[tuple[str, dict]]:
        """The tool parser's deltas (tools/parser.py): content, a call's name, its arguments' JSON."""
        events: list[tuple[str, dict]] = []
        for kind, *rest in deltas:
            if kind == "content":
                events += self.text(rest[0])
            elif kind == "call":
                events += self._start({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": rest[2],
                                       "input": {}})
                self.call_at[rest[0]] = len(self.content) - 1
                self.arguments[len(self.content) - 1] = ""
            elif rest[1]:
                at = self.call_at[rest[0]]
                self.arguments[at] += rest[1]
                events.append(("content_block_delta", {"type": "content_block_delta", "index": at, "delta": {
                    "type": "input_json_delta", "partial_json": rest[1]}}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        """The open block's end (a thinking block's signature first, as the API sends it)."""
        if self.open is None:
            return []
        at, block = len(self.content) - 1, self.content[-1]
        events = []
        if block["type"] == "thinking":      # opaque to clients: they send it back with the block
            block["signature"] = hashlib.sha256(block["thinking"].encode()).hexdigest()
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif block["type"] == "tool_use":
            try:
                value = json.loads(self.arguments[at] or "{}")
            except json.JSONDecodeError:      # cut short (max_tokens, a stop sequence)
                value = {}
            block["input"] = value if isinstance(value, dict) else {}
        self.open = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": at})]


class Answer:
    """One Messages request's answer as its engine events come: text through the reasoning parser
    (when the model thinks) and the tool parser (when the request has tools) into `Blocks`."""

    def __init__(self, gen, request: MessagesRequest, model: str) -> None:
        self.gen, self.request, self.model = gen, request, model
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.blocks = Blocks()
        self.reasoning = getattr(gen, "reasoning", None)       # serve/reasoning.py's parser, or None

    def start(self) -> tuple[str, dict]:
        usage = {"input_tokens": len(self.gen.parsed.prompt_ids), "output_tokens": 0,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        return "message_start", {"type": "message_start", "message": dict(self.message([], None, None), usage=usage)}

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence}

    def _text(self, delta: str) -> list[tuple[str, dict]]:
        events = []
        if self.reasoning is not None:
            thought, delta = self.reasoning.feed(delta)
            events += self.blocks.thinking(thought)
        return events + self._content(delta)

    def _content(self, delta: str, final: bool = False) -> list[tuple[str, dict]]:
        tools = self.gen.tools
        if tools is None:
            return self.blocks.text(delta)
        return self.blocks.tool_deltas(tools.feed(delta) + (tools.finish() if final else []))

    def tokens(self, event: Tokens) -> list[tuple[str, dict]]:
        return self._text(self.gen.text.add(event.ids, False)[0])

    def finished(self, event: Finished) -> tuple[list[tuple[str, dict]], dict]:
        """The last pieces, the blocks closed and the message's end: (events, the whole message)."""
        gen = self.gen
        events = self._text(gen.text.finish(event.stop_text_index))
        rest = ""
        if self.reasoning is not None:
            thought, rest = self.reasoning.finish()
            events += self.blocks.thinking(thought)
        events += self._content(rest, final=True) + self.blocks.close()
        stop_reason, stop_sequence = self.stop_reason(event)
        usage = anthropic_usage(event.usage)
        events.append(("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage,
            "speculation": event.speculation}))
        events.append(("message_stop", {"type": "message_stop"}))
        whole = dict(self.message(self.blocks.content, stop_reason, stop_sequence), usage=usage,
                     speculation=event.speculation)
        return events, whole

    def stop_reason(self, event: Finished) -> tuple[str, str | None]:
        tools = self.gen.tools
        if event.reason == "length":
            return "max_tokens", None
        if tools is not None and tools.calls and tools.calls_complete():
            return "tool_use", None
        if event.stop_text_index is not None:
            text = self.gen.text.full_text(None)
            found = [s for s in self.request.stop_sequences if text.startswith(s, event.stop_text_index)]
            if found:
                return "stop_sequence", max(found, key=len)
        return "end_turn", None


def anthropic_usage(usage: dict) -> dict:
    """Chat completions' usage in the Messages API's terms (its input_tokens leave out cache reads)."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def clamped(parsed, asked: int, state):
    """`parsed` with max_tokens = the request's, at most the room its prompt leaves in the context
    and in the KV pool (protocol.parse refused a prompt that leaves none)."""
    prompt = len(parsed.prompt_ids)
    pool = min((c.usable_blocks * c.block_size for c in state.engine.runner.caches if hasattr(c, "usable_blocks")),
               default=state.ctx.max_model_len)
    room = min(state.ctx.max_model_len, pool) - prompt
    if room < 1:
        raise ApiError(400, f"prompt ({prompt} tokens) leaves no room in the {pool} tokens the server's KV pool "
                            f"holds (--num-blocks)", param="messages")
    return dataclasses.replace(parsed, params=dataclasses.replace(parsed.params, max_tokens=min(asked, room)))


async def messages(http: HttpRequest) -> Response:
    """POST /v1/messages: an answer as Anthropic's `message`, or its stream of events."""
    # imported here: app.py imports this module for its routes
    from .generation import Generation
    from .protocol import parse
    state = http.app.state.serve
    try:
        request = translate(await read_json(http))
        try:
            parsed = parse(request.chat, state.ctx, chat=True)
        except ApiError as exc:
            raise ApiError(exc.status, request.param(exc.message), exc.param) from None
        parsed = dataclasses.replace(clamped(parsed, request.max_tokens, state),
                                     thinking_budget=request.thinking_budget)
        queue: asyncio.Queue = asyncio.Queue()
        gen = Generation(state, parsed, queue, Mailbox.of(http.app.state))
        try:
            state.engine.submit(gen.request)
        except ShuttingDown as exc:
            raise ApiError(503, str(exc)) from None
        except QueueFull as exc:
            raise ApiError(429, str(exc)) from None
        answer = Answer(gen, request, parsed.model)
        if parsed.stream:
            return StreamingResponse(stream(answer, queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await whole(answer, queue, http)
    except ApiError as exc:
        return anthropic_error(exc.status, exc.message)
    except Exception as exc:  # noqa: BLE001 -- never a traceback to the client
        log.exception("Messages API request failed")
        return anthropic_error(500, f"internal server error ({type(exc).__name__})")


async def stream(answer: Answer, queue: asyncio.Queue):
    """The API's server-sent events: message_start, each block's start / deltas / stop (the first
    start followed by a ping), message_delta, message_stop; an engine error as an `error` event."""
    gen = answer.gen
    try:
        yield sse(*answer.start())
        while True:
            try:
                first = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield sse("ping", {"type": "ping"})
                continue
            for _, event in merge_tokens(drain(first, queue)):
                if isinstance(event, Tokens):
                    events = answer.tokens(event)
                elif isinstance(event, Finished):
                    gen.done = True
                    events = answer.finished(event)[0]
                else:
                    gen.done = True
                    events = [("error", anthropic_error_body(event.status, event.message))]
                for name, data in events:
                    yield sse(name, data)
                if gen.done:
                    return
    except Exception as exc:  # noqa: BLE001 -- the stream has begun: an error event, not a traceback
        log.exception("Messages API stream failed")
        yield sse("error", anthropic_error_body(500, f"internal server error ({type(exc).__name__})"))
    finally:
        if not gen.done:
            gen.state.engine.abort(gen.request.id)


async def whole(answer: Answer, queue: asyncio.Queue, http: HttpRequest) -> Response:
    """The whole message; a client that disconnects aborts its request at once."""
    from .generation import client_gone
    gen = answer.gen
    watcher = asyncio.ensure_future(client_gone(http))
    watcher.add_done_callback(lambda task: task.cancelled() or queue.put_nowait((None, None)))
    try:
        while True:
            owner, event = await queue.get()
            if owner is None:                               # the client went away
                return Response(status_code=499)
            if isinstance(event, Tokens):
                answer.tokens(event)
            elif isinstance(event, Finished):
                gen.done = True
                return JSONResponse(answer.finished(event)[1])
            else:
                gen.done = True
                return anthropic_error(event.status, event.message)
    finally:
        watcher.cancel()
        if not gen.done:
            gen.state.engine.abort(gen.request.id)


async def count_tokens(http: HttpRequest) -> Response:
    """POST /v1/messages/count_tokens: `{"input_tokens": N}`, the prompt /v1/messages would render."""
    state = http.app.state.serve
    try:
        request = translate(await read_json(http), count_only=True)
        try:
            ids = prompt_ids(request.chat, state.ctx)
        except ApiError as exc:
            raise ApiError(exc.status, request.param(exc.message), exc.param) from None
        return JSONResponse({"input_tokens": len(ids)})
    except ApiError as exc:
        return anthropic_error(exc.status, exc.message)
    except Exception as exc:  # noqa: BLE001
        log.exception("Messages API count_tokens failed")
        return anthropic_error(500, f"internal server error ({type(exc).__name__})")


def prompt_ids(chat: dict, ctx) -> list[int]:
    """The prompt's token ids as protocol.parse renders a chat body (model, tools and template), with
    no limit on its length: a count may be asked for a prompt longer than the context."""
    from ..params import ParamError
    from .protocol import _chat_ids
    from .tools import parse_tools
    model = chat.get("model", ctx.model_names[0])
    if not isinstance(model, str) or model not in ctx.model_names:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{ctx.model_names[0]}`")
    try:
        tools = parse_tools(chat, ctx.tool_format() if chat.get("tools") is not None else None)
    except ParamError as exc:
        raise ApiError(400, str(exc), param="tools") from None
    return _chat_ids(chat, ctx, tools)
