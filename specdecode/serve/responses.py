"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id} and its /cancel, on
the engine core.

A request is translated to the chat request `protocol.parse` takes (responses_input.py) and runs
as one chat `Generation` (the template, tools, structured output, speculation fields, the tool
parser all as on /v1/chat/completions); what differs is the answer's shape. `Output` turns the
answer's text, as it streams, into the response's output items (`message`, `function_call`,
`reasoning`) and the API's events, numbered by `sequence_number`; a non-streamed response is the
same events' last `response`. `max_output_tokens` beyond the room the context (and the KV pool)
leaves after the prompt is clamped to it: agents ask for more than a small model's context.
Responses with `store` (OpenAI's default: true) are kept in a bounded in-memory `ResponseStore`
for `previous_response_id` and GET; it belongs to one server (one Ray replica).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections import OrderedDict

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.sequence import Finished, QueueFull, ShuttingDown, Tokens
from .errors import ApiError, read_json
from .events import Mailbox, drain, merge_tokens
from .generation import Generation, client_gone, error, log
from .protocol import ParsedRequest, parse
from .responses_input import chat_body, check_echoed, echoed, param_of

MAX_STORED = 256         # responses kept for previous_response_id / GET (the oldest go first)


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex + uuid.uuid4().hex[:16]


class ResponseStore:
    """Stored responses by id, each with the items of its conversation before its output, at
    most `limit` (least recently used dropped)."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit, self.entries = limit, OrderedDict()

    @staticmethod
    def of(app_state) -> ResponseStore:
        return app_state.__dict__.setdefault("_responses", ResponseStore())

    def put(self, response: dict, items: list[dict]) -> None:
        self.entries[response["id"]] = (response, items)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self.entries.pop(response_id, None) is not None


class Output:
    """A response's output items as its answer streams, and the events that build them: text goes
    to a `message` item, a tool call to a `function_call` item, thinking to a `reasoning` item;
    whatever comes next closes the open item."""

    def __init__(self, response: dict) -> None:
        self.response, self.items = response, response["output"]
        self.seq = 0
        self.open: dict | None = None            # the item being written
        self.calls: dict[int, dict] = {}         # the parser's call index -> its item
        self.failure: tuple[int, str] | None = None   # the engine's (status, message) when it failed

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _start(self, item: dict) -> list[dict]:
        events = self.close()
        self.open = item
        self.items.append(item)
        return events + [self.event("response.output_item.added", output_index=len(self.items) - 1,
                                    item=dict(item, content=[]) if "content" in item else dict(item))]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def text(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = []
        if self.open is None or self.open["type"] != "message":
            item = {"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            events = self._start(item)
            events.append(self.event("response.content_part.added", **self._where(item), content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.open["content"][0]["text"] += delta
        return events + [self.event("response.output_text.delta", **self._where(self.open), content_index=0,
                                    delta=delta, logprobs=[])]

    def reasoning(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
            events = self._start(item)
            events.append(self.event("response.content_part.added", **self._where(item), content_index=0,
                                     part={"type": "reasoning_text", "text": ""}))
        self.open["content"][0]["text"] += delta
        return events + [self.event("response.reasoning_text.delta", **self._where(self.open), content_index=0,
                                    delta=delta)]

    def call(self, index: int, call_id: str, name: str) -> list[dict]:
        item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}
        self.calls[index] = item
        return self._start(item)

    def arguments(self, index: int, piece: str) -> list[dict]:
        item = self.calls[index]
        item["arguments"] += piece
        return [self.event("response.function_call_arguments.delta", **self._where(item), delta=piece)]

    def parsed(self, deltas: list[tuple]) -> list[dict]:
        """Events of the tool parser's deltas (tools/parser.py): content, a call's name, its arguments."""
        events = []
        for kind, *rest in deltas:
            events += self.text(rest[0]) if kind == "content" else \
                self.call(*rest) if kind == "call" else self.arguments(*rest)
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """The open item's closing events."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where, events = self._where(item), []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=[]),
                       self.event("response.content_part.done", **where, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]),
                       self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        return events + [self.event("response.output_item.done", output_index=where["output_index"], item=item)]


def feed(gen: Generation, out: Output, text: str, final: bool = False) -> list[dict]:
    """Events of the answer's next text: thinking (a reasoning parser, where the model has one),
    then content and tool calls (the tool parser, where the request has tools)."""
    reasoning = gen.reasoning            # reasoning.py's parser, or None
    events = []
    if reasoning is not None:
        thought, text = reasoning.feed(text)
        events += out.reasoning(thought)
        if final:
            thought, rest = reasoning.finish()
            events += out.reasoning(thought)
            text += rest
    if gen.tools is None:
        return events + out.text(text)
    return events + out.parsed(gen.tools.feed(text) + (gen.tools.finish() if final else []))


def usage_of(usage: dict, gen: Generation) -> dict:
    """The API's usage of the engine's: cached_tokens from the prefix cache; no cache writes, as
    OpenAI's implicit caching reports; the reasoning's tokens, markers included."""
    thought = gen.reasoning_tokens() if gen.reasoning is not None else 0
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}


async def run(gen: Generation, queue: asyncio.Queue, out: Output, store: ResponseStore | None, items: list[dict]):
    """The response's events, the last one `response.completed` / `.incomplete` / `.failed` (whose
    `response` is the whole answer); the request is aborted if the consumer stops early."""
    response = out.response
    try:
        yield out.event("response.created", response=dict(response, output=[]))
        yield out.event("response.in_progress", response=dict(response, output=[]))
        while True:
            for g, event in merge_tokens(drain(await queue.get(), queue)):
                if g is None:
                    return                                   # a non-streamed request's client went away
                if isinstance(event, Tokens):
                    for e in feed(gen, out, gen.text.add(event.ids, False)[0]):
                        yield e
                    continue
                gen.done = True
                if not isinstance(event, Finished):
                    out.failure = (event.status, event.message)
                    response.update(status="failed", error={
                        "code": "rate_limit_exceeded" if event.status == 429 else "server_error",
                        "message": event.message})
                    for e in out.close("incomplete"):
                        yield e
                    yield out.event("response.failed", response=response)
                    return
                for e in feed(gen, out, gen.text.finish(event.stop_text_index), final=True):
                    yield e
                cut = event.reason == "length"
                for e in out.close("incomplete" if cut else "completed"):
                    yield e
                response.update(status="incomplete" if cut else "completed", completed_at=int(time.time()),
                                incomplete_details={"reason": "max_output_tokens"} if cut else None,
                                usage=usage_of(event.usage, gen), speculation=event.speculation)
                if store is not None:
                    store.put(response, items)
                yield out.event("response.incomplete" if cut else "response.completed", response=response)
                return
    finally:
        if not gen.done:
            gen.state.engine.abort(gen.request.id)


def with_room(parsed: ParsedRequest, body: dict, state) -> ParsedRequest:
    """max_output_tokens (or the server's default) clamped to what the context and the KV pool
    leave after the prompt; a prompt the pool cannot hold is refused."""
    asked = body.get("max_output_tokens")
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
        raise ApiError(400, f"max_output_tokens must be an integer >= 1, got {asked!r:.40}", param="max_output_tokens")
    prompt = len(parsed.prompt_ids)
    cache = state.engine.runner.cache
    room = min(state.ctx.max_model_len, cache.usable_blocks * cache.block_size) - prompt
    if room < 1 or not state.engine.runner.fits(prompt + 1):
        raise ApiError(400, f"prompt ({prompt} tokens) leaves no room in the {cache.usable_blocks} KV blocks of "
                            f"{cache.block_size} tokens the server has (--num-blocks)", param="input",
                       code="context_length_exceeded")
    tokens = min(parsed.params.max_tokens if asked is None else asked, room)
    return dataclasses.replace(parsed, params=dataclasses.replace(parsed.params, max_tokens=tokens))


def skeleton(body: dict, parsed: ParsedRequest, chat: dict) -> dict:
    """The response object before its output: the request's settings as the API echoes them."""
    tools = [dict(t["function"], type="function") for t in chat.get("tools", [])]
    for tool in tools:
        tool.setdefault("parameters", None)
        tool.setdefault("strict", None)
    choice = chat.get("tool_choice") or "auto"       # as the server took it (a hosted tool's: auto)
    if isinstance(choice, dict):
        choice = {"type": "function", "name": choice["function"]["name"]}
    return {"id": new_id("resp_"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": parsed.params.max_tokens,
            "model": parsed.model, "output": [], "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": echoed(body, "reasoning.effort"), "summary": echoed(body, "reasoning.summary")},
            "store": body.get("store") is not False, "temperature": parsed.params.temperature,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": choice, "tools": tools, "top_p": parsed.params.top_p,
            "truncation": echoed(body, "truncation") or "disabled", "usage": None, "user": body.get("user"),
            "metadata": body.get("metadata") or {}, "prompt_cache_key": body.get("prompt_cache_key")}


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def create_response(http: HttpRequest) -> Response:
    """POST /v1/responses."""
    state = http.app.state.serve
    store = ResponseStore.of(http.app.state)
    try:
        body = await read_json(http)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        check_echoed(body)
        history: list[dict] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            entry = store.get(previous)
            if entry is None:
                raise ApiError(404, f"previous_response_id {previous!r:.80} names no stored response (this server "
                                    f"keeps the last {store.limit} responses made with store: true)",
                               param="previous_response_id", code="previous_response_not_found")
            history = entry[1] + entry[0]["output"]
        if body.get("store") is not None and not isinstance(body["store"], bool):
            raise ApiError(400, f"store must be true or false, got {body['store']!r:.40}", param="store")
        chat, items, where = chat_body(body, history)
        try:
            parsed = parse(chat, state.ctx, chat=True)
        except ApiError as exc:
            raise param_of(exc, where) from None
        parsed = with_room(parsed, body, state)
        queue: asyncio.Queue = asyncio.Queue()
        gen = Generation(state, parsed, queue, Mailbox.of(http.app.state))
        try:
            state.engine.submit(gen.request)
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), code="service_unavailable") from None
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="queue_full") from None
        out = Output(skeleton(body, parsed, chat))
        events = run(gen, queue, out, store if out.response["store"] else None, items)
        if parsed.stream:
            return StreamingResponse((sse(e) async for e in events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(events, out, queue, http)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except Exception as exc:  # noqa: BLE001 -- never a traceback to the client
        log.exception("request failed")
        return error(500, f"internal server error ({type(exc).__name__})")


async def collect(events, out: Output, queue: asyncio.Queue, http: HttpRequest) -> Response:
    """A non-streamed response: its last event's `response`; a client that goes away aborts it."""
    watcher = asyncio.ensure_future(client_gone(http))
    watcher.add_done_callback(lambda task: task.cancelled() or queue.put_nowait((None, None)))
    last = None
    try:
        async for event in events:
            last = event
    finally:
        watcher.cancel()
        await events.aclose()
    if last is None or last["type"] not in ("response.completed", "response.incomplete", "response.failed"):
        return Response(status_code=499)                 # the client went away
    if out.failure is not None:
        return error(*out.failure)
    return JSONResponse(last["response"])


def not_stored(response_id: str) -> JSONResponse:
    return error(404, f"No response with id {response_id!r:.80} is stored here (responses made with store: "
                      f"false are not kept, and only the last {MAX_STORED} are)", param="response_id")


async def response_by_id(http: HttpRequest) -> Response:
    """GET /v1/responses/{id}: a stored response; DELETE: the response forgotten (OpenAI's answer:
    its id, `deleted: true`), after which neither GET nor previous_response_id finds it."""
    response_id = http.path_params["response_id"]
    store = ResponseStore.of(http.app.state)
    if http.method == "DELETE":
        if not store.delete(response_id):
            return not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    entry = store.get(response_id)
    return not_stored(response_id) if entry is None else JSONResponse(entry[0])


async def cancel_response(http: HttpRequest) -> Response:
    """POST /v1/responses/{id}/cancel. OpenAI cancels only responses made with `background: true`,
    which this server does not run: every response here was answered in its own request (a stream
    is cancelled by closing it), so a stored one gets OpenAI's 400 for a foreground response."""
    response_id = http.path_params["response_id"]
    entry = ResponseStore.of(http.app.state).get(response_id)
    if entry is None:
        return not_stored(response_id)
    return error(400, f"Responses can only be cancelled if they were created with background=true; response "
                      f"{response_id!r:.80} was answered in its own request (status {entry[0]['status']}): "
                      f"close a stream to stop it", param="response_id")
